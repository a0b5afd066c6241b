"""The CPU rule list, most specific first; ParallelFallback makes sure every PrimFunc is parallel."""

from __future__ import annotations

from .contraction import Contraction
from .depthwise import Depthwise
from .fallback import ParallelFallback
from .injective import Injective
from .pool import WindowReduction
from .reduction import PlainReduction, RowReduction
from .strassen import Strassen
from .winograd import Winograd


def cpu_rules(prepack: bool = True) -> list:
    return [
        WindowReduction(),
        Winograd(prepack=prepack),
        Strassen(prepack=prepack),
        Depthwise(),
        PlainReduction(),
        Contraction(prepack=prepack),
        RowReduction(),
        Injective(),
        ParallelFallback(),
    ]


__all__ = [
    "Contraction",
    "Depthwise",
    "Injective",
    "ParallelFallback",
    "PlainReduction",
    "RowReduction",
    "Strassen",
    "WindowReduction",
    "Winograd",
    "cpu_rules",
]
