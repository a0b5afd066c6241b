#!/usr/bin/env python3
"""The model zoo: real torchvision / Hugging Face models through both torch ONNX exporters.

Needs the ``zoo`` extra (torch, torchvision, transformers, onnxscript) for exporting; building and
checking the cached ``.onnx`` files needs only the project itself.

    python scripts/zoo.py export                     # export every model with both exporters
    python scripts/zoo.py run --models resnet18,bert # build (llvm + cuda) -> numerics -> timing
    python scripts/zoo.py run --skip-timing --exporters torchscript
    python scripts/zoo.py report                     # docs/zoo.md + docs/zoo.png from the results

Weights are random (torchvision ``weights=None``; Hugging Face models from a ``Config``, never
downloaded), ``model.eval()``, batch 1, 224x224 images, 128 tokens. Exports go to a cache folder
(``--cache``, default /work/zoo/onnx, never committed) as ``<model>.<exporter>.onnx``. Results are
kept per model and exporter in ``<cache>/../results.json``, so a run can stop and resume, and
``--models``/``--exporters`` run a part of the zoo; ``report`` writes the table from all results.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

DEFAULT_CACHE = Path(os.environ.get("TVM_FUSION_ZOO", "/work/zoo/onnx"))
EXPORTERS = ("torchscript", "dynamo")
IMAGE = (1, 3, 224, 224)
SEQ = 128


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    source: str  # "torchvision" or "transformers"
    builder: str  # torchvision function name, or the transformers model class


VISION = [
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "squeezenet1_1",
    "densenet121",
    "shufflenet_v2_x1_0",
    "convnext_tiny",
    "regnet_y_400mf",
    "vit_b_16",
]
TEXT = {"bert": "BertModel", "distilbert": "DistilBertModel", "roberta": "RobertaModel", "gpt2": "GPT2Model"}
TEXT["t5_encoder"] = "T5EncoderModel"

ZOO: dict[str, ZooModel] = {n: ZooModel(n, "torchvision", n) for n in VISION}
ZOO.update({n: ZooModel(n, "transformers", cls) for n, cls in TEXT.items()})


def _hf_config(name: str):
    """The published architecture of each checkpoint, as a Config (no download)."""
    import transformers as tf

    if name == "bert":  # bert-base-uncased
        return tf.BertConfig()
    if name == "distilbert":  # distilbert-base-uncased
        return tf.DistilBertConfig()
    if name == "roberta":  # roberta-base
        return tf.RobertaConfig(
            vocab_size=50265,
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            layer_norm_eps=1e-5,
        )
    if name == "gpt2":  # gpt2 (124M)
        return tf.GPT2Config()
    if name == "t5_encoder":  # t5-small
        return tf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128)
    raise KeyError(name)


def torch_model(name: str):
    """``(module in eval mode, example inputs, input names)`` with seeded random weights."""
    import torch

    torch.manual_seed(0)
    spec = ZOO[name]
    if spec.source == "torchvision":
        import torchvision

        model = getattr(torchvision.models, spec.builder)(weights=None).eval()
        return model, (torch.randn(*IMAGE),), ["input"]

    import transformers

    inner = getattr(transformers, spec.builder)(_hf_config(name)).eval()

    class LastHidden(torch.nn.Module):
        """What a user exports: ids + mask in, the last hidden state out."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, 1000, (1, SEQ), dtype=torch.int64)
    mask = torch.ones(1, SEQ, dtype=torch.int64)
    return LastHidden(inner).eval(), (ids, mask), ["input_ids", "attention_mask"]


def onnx_path(cache: Path, name: str, exporter: str) -> Path:
    return cache / f"{name}.{exporter}.onnx"


def export(name: str, exporter: str, cache: Path, force: bool = False) -> Path:
    """Export one model with one exporter (atomically: readers never see a half-written file)."""
    import torch

    path = onnx_path(cache, name, exporter)
    if path.exists() and not force:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    model, args, input_names = torch_model(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".onnx", dir=cache)
    os.close(fd)
    try:
        # as users call it: not under torch.no_grad(), where nn.MultiheadAttention takes its fused
        # fast path (aten::_native_multi_head_attention), which the TorchScript exporter cannot write
        if exporter == "torchscript":
            torch.onnx.export(
                model,
                args,
                tmp,
                dynamo=False,
                opset_version=17,
                input_names=input_names,
                output_names=["output"],
            )
        else:
            torch.onnx.export(
                model,
                args,
                tmp,
                dynamo=True,
                external_data=False,
                input_names=input_names,
                output_names=["output"],
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def feeds_for(model) -> dict[str, np.ndarray]:
    """Inputs for a zoo model: images ~ N(0, 1); token ids in [0, 1000); attention mask all ones."""
    rng = np.random.default_rng(0)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in inp.type.tensor_type.shape.dim]
        if "mask" in inp.name:
            feeds[inp.name] = np.ones(shape, np.int64)
        elif inp.type.tensor_type.elem_type == 7:  # int64 ids
            feeds[inp.name] = rng.integers(0, 1000, shape).astype(np.int64)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# -- command line ---------------------------------------------------------------------------------
def _select(text: str | None, known, what: str) -> list[str]:
    if not text:
        return list(known)
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [c for c in chosen if c not in known]
    if bad:
        raise SystemExit(f"error: unknown {what} {bad}; known: {', '.join(known)}")
    return chosen


def cmd_export(args) -> int:
    failed = 0
    for name in _select(args.models, ZOO, "model"):
        for exporter in _select(args.exporters, EXPORTERS, "exporter"):
            start = time.perf_counter()
            try:
                path = export(name, exporter, args.cache, force=args.force)
                print(f"{name}.{exporter}: {path} ({time.perf_counter() - start:.0f} s)", flush=True)
            except Exception as err:  # report and go on: one model's exporter bug must not stop the zoo
                failed += 1
                line = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                print(f"{name}.{exporter}: export failed: {type(err).__name__}: {line}", flush=True)
                if args.verbose:
                    traceback.print_exc()
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, func, help_text in [("export", cmd_export, "export the zoo to the cache folder")]:
        s = sub.add_parser(name, help=help_text)
        s.set_defaults(func=func)
        s.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder of the exported .onnx files")
        s.add_argument("--models", help=f"comma-separated subset of: {', '.join(ZOO)}")
        s.add_argument("--exporters", help="comma-separated subset of: torchscript,dynamo")
        s.add_argument("-v", "--verbose", action="store_true")
    sub.choices["export"].add_argument("--force", action="store_true", help="re-export existing files")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
