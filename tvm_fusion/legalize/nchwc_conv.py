"""NCHW{c} conv2d legalization: Relax 0.27's conv2d legalization returns blocked layouts unchanged.

``RewriteLayout`` writes convs in ``NCHW{i}c`` data / ``OIHW{i}i{o}o`` kernel layouts; this lowers
them to our own TE compute (``conv2d_NCHWc`` / ``depthwise_conv2d_NCHWc`` blocks, which the
Contraction schedule rule recognises). Anything else goes to TVM's own legalization.
"""

from __future__ import annotations

import re

from tvm import relax, te, topi

from .conv_args import out_dtype, static_shapes

_NCHWC_RE = re.compile(r"NCHW(\d+)c")
_OIHWIO_RE = re.compile(r"OIHW(\d+)i(\d+)o")


def _nchwc_conv_te(data, kernel, strides, padding, dilation, depthwise, out_dtype):
    """TE compute for NCHW{ib}c x OIHW{ib}i{ob}o -> NCHW{ob}c (or depthwise OIHW1i{b}o).

    Blocks: ``data_pad`` (only if padding), then ``conv2d_NCHWc`` / ``depthwise_conv2d_NCHWc``,
    spatial iters (n, oc_chunk, oh, ow, oc_block) and reduce iters (ic_chunk, kh, kw, ic_block)
    (depthwise: (kh, kw)).
    """
    n, ic_chunk, ih, iw, ic_bn = (int(x) for x in data.shape)
    oc_chunk, k_icc, kh_, kw_, k_icb, oc_bn = (int(x) for x in kernel.shape)
    sh, sw = (int(s) for s in strides)
    dh, dw = (int(d) for d in dilation)
    pt, pl, pb, pr = (int(p) for p in padding)
    oh_ = (ih + pt + pb - (kh_ - 1) * dh - 1) // sh + 1
    ow_ = (iw + pl + pr - (kw_ - 1) * dw - 1) // sw + 1
    if pt or pl or pb or pr:
        data = topi.nn.pad(data, [0, 0, pt, pl, 0], [0, 0, pb, pr, 0], name="data_pad")
    out_dtype = out_dtype or data.dtype
    kh = te.reduce_axis((0, kh_), name="kh")
    kw = te.reduce_axis((0, kw_), name="kw")
    if depthwise:
        return te.compute(
            (n, oc_chunk, oh_, ow_, oc_bn),
            lambda b, occ, oh, ow, ocb: te.sum(
                data[b, occ, oh * sh + kh * dh, ow * sw + kw * dw, ocb].astype(out_dtype)
                * kernel[occ, 0, kh, kw, 0, ocb].astype(out_dtype),
                axis=[kh, kw],
            ),
            name="depthwise_conv2d_NCHWc",
        )
    icc = te.reduce_axis((0, ic_chunk), name="ic_chunk")
    icb = te.reduce_axis((0, ic_bn), name="ic_block")
    return te.compute(
        (n, oc_chunk, oh_, ow_, oc_bn),
        lambda b, occ, oh, ow, ocb: te.sum(
            data[b, icc, oh * sh + kh * dh, ow * sw + kw * dw, icb].astype(out_dtype)
            * kernel[occ, icc, kh, kw, icb, ocb].astype(out_dtype),
            axis=[icc, kh, kw, icb],
        ),
        name="conv2d_NCHWc",
    )


def legalize_conv2d_nchwc(bb: relax.BlockBuilder, call: relax.Call):
    """Legalize an NCHW{i}c conv2d (kernel OIHW{i}i{o}o, out NCHW{o}c); None if not that form."""
    attrs = call.attrs
    dm = _NCHWC_RE.fullmatch(str(attrs.data_layout))
    om = _NCHWC_RE.fullmatch(str(attrs.out_layout))
    km = _OIHWIO_RE.fullmatch(str(attrs.kernel_layout))
    if not (dm and om and km):
        return None
    shapes = static_shapes(call)
    if shapes is None:
        return None  # symbolic shapes: not supported
    dshape, kshape = shapes
    groups = int(attrs.groups)
    cin = dshape[1] * dshape[4]
    depthwise = (
        groups > 1 and groups == cin and kshape[1] == 1 and kshape[4] == 1 and kshape[0] * kshape[5] == cin
    )
    if depthwise:
        if not int(dm.group(1)) == int(om.group(1)) == int(km.group(2)) or int(km.group(1)) != 1:
            return None
    elif groups != 1 or int(dm.group(1)) != int(km.group(1)) or int(om.group(1)) != int(km.group(2)):
        return None
    dtype = out_dtype(attrs)
    return bb.call_te(
        _nchwc_conv_te,
        call.args[0],
        call.args[1],
        [int(x) for x in attrs.strides],
        [int(x) for x in attrs.padding],
        [int(x) for x in attrs.dilation],
        depthwise,
        dtype,
        primfunc_name_hint="depthwise_conv2d_NCHWc" if depthwise else "conv2d_NCHWc",
    )
