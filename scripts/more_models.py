#!/usr/bin/env python3
"""Models outside the zoo: more torchvision / Hugging Face models, each through both exporters.

The zoo (``scripts/zoo.py``) is the issue's fixed list; this is the check "does it also work on a
model nobody tuned it for". Same rules: random weights (torchvision ``weights=None``, BN statistics
calibrated; Hugging Face models from a ``Config``, smaller than the published ones for the decoder
LLMs), batch 1, 224x224 images (inception_v3: 299x299) or 128 tokens (CLIP's text model: 77).
Needs the ``zoo`` extra. Each model and exporter runs in a child process (a crash or an
out-of-memory kill costs one row):

    python scripts/more_models.py                       # all, both exporters -> docs/more_models.md
    python scripts/more_models.py --models llama,swin_t --exporters dynamo

Each row: export, llvm build, max |ours - ORT| / max |ORT|, then ours and ORT timed interleaved in
one process (``tvm_fusion.benchmark.interleaved_ms``), both with the target's cores. Exports are cached under
``--cache`` (default: $TVM_FUSION_MORE or /work/zoo/more) as ``<model>.<exporter>.onnx``: delete
a file after changing its model's config. Rows go to ``docs/more_models.json`` as they finish;
``--report`` rewrites the table from it; ``--note "..."`` adds a dated entry to the report's
measurement history, which every rewrite keeps.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (scripts/zoo.py: exporters, model inputs, interleaved timing)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = Path(os.environ.get("TVM_FUSION_MORE", "/work/zoo/more"))
ROW = "ROW "  # the child's result line: ROW <json>
# What the table cannot say, kept in the report (docs/more_models.md, "Notes").
STANDING_NOTES = [
    "Both fcn_resnet50 rows are past 1e-4: F(4) Winograd makes its rounding error 1.7x the direct "
    "conv's (against a float64 run: ours 2.0e-4, all-direct 1.2e-4, ORT 8.5e-5; docs/winograd.md).",
    "BEiT's dynamo export fails in torch.onnx with SDPA (as T5's did in the zoo).",
    "Not added: Mixtral (neither exporter takes transformers 5's expert dispatch) and Nystromformer "
    "(its forward fails in torch with an attention mask).",
]
VISION = [
    "googlenet",
    "inception_v3",
    "mnasnet1_0",
    "mobilenet_v3_large",
    "regnet_x_400mf",
    "squeezenet1_0",
    "alexnet",
    "resnext50_32x4d",
    "efficientnet_v2_s",
    "swin_t",
    "maxvit_t",
    "vit_b_32",
    "swin_v2_t",  # cosine attention, log-spaced continuous position bias (an MLP over coordinates)
    "efficientnet_b3",
    "vgg16",  # 3x3 convs at 224x224 and 112x112; a 25088 -> 4096 classifier (411 MB of weights)
    "wide_resnet50_2",
]
_DECODER = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1376)
_LLM = dict(_DECODER, vocab_size=32000, max_position_embeddings=512)
_ENCODER = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, intermediate_size=1536)
TEXT = {  # name -> (transformers model class, config class, config arguments)
    "llama": ("LlamaModel", "LlamaConfig", dict(_LLM, num_key_value_heads=2)),
    "qwen2": ("Qwen2Model", "Qwen2Config", dict(_LLM, num_key_value_heads=2)),
    "mistral": ("MistralModel", "MistralConfig", dict(_LLM, num_key_value_heads=2)),
    "phi": ("PhiModel", "PhiConfig", _LLM),
    "albert": (
        "AlbertModel",
        "AlbertConfig",
        dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    ),
    "electra": ("ElectraModel", "ElectraConfig", {}),
    "xlm_roberta": ("XLMRobertaModel", "XLMRobertaConfig", dict(max_position_embeddings=514, pad_token_id=1)),
    "deberta_v2": (
        "DebertaV2Model",
        "DebertaV2Config",
        _ENCODER,
    ),
    "mpnet": ("MPNetModel", "MPNetConfig", {}),
    "clip_text": ("CLIPTextModel", "CLIPTextConfig", {}),
    "mobilebert": ("MobileBertModel", "MobileBertConfig", {}),
    # decoders with other position schemes and attention layouts: OPT's offset learned positions,
    # BLOOM's ALiBi, GPT-Neo's local attention, Gemma's GeGLU, GPT-BigCode's multi-query attention,
    # Falcon's parallel attention + MLP; RoFormer's rotary encoder; SqueezeBERT's grouped 1-D convs
    "opt": (
        "OPTModel",
        "OPTConfig",
        dict(
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            ffn_dim=1376,
            word_embed_proj_dim=512,
            vocab_size=32000,
            max_position_embeddings=512,
        ),
    ),
    "bloom": ("BloomModel", "BloomConfig", dict(hidden_size=512, n_layer=4, n_head=8, vocab_size=32000)),
    "gpt_neo": (
        "GPTNeoModel",
        "GPTNeoConfig",
        dict(
            hidden_size=512,
            num_layers=4,
            num_heads=8,
            attention_types=[[["global", "local"], 2]],
            window_size=64,
            intermediate_size=1376,
            vocab_size=32000,
            max_position_embeddings=512,
        ),
    ),
    "gemma": ("GemmaModel", "GemmaConfig", dict(_LLM, num_key_value_heads=2, head_dim=64)),
    "gpt_bigcode": (
        "GPTBigCodeModel",
        "GPTBigCodeConfig",
        dict(
            n_embd=512, n_layer=4, n_head=8, n_inner=1376, vocab_size=32000, n_positions=512, multi_query=True
        ),
    ),
    # a state-space model: a selective scan instead of attention
    "mamba": ("MambaModel", "MambaConfig", dict(hidden_size=512, num_hidden_layers=4, vocab_size=32000)),
    # Falcon keeps its own defaults otherwise: multi-query attention, 65024 tokens, 4x MLP
    "falcon": (
        "FalconModel",
        "FalconConfig",
        dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8),
    ),
    "roformer": (
        "RoFormerModel",
        "RoFormerConfig",
        dict(_ENCODER, embedding_size=384),
    ),
    "squeezebert": (
        "SqueezeBertModel",
        "SqueezeBertConfig",
        dict(_ENCODER, embedding_size=384),
    ),
    # more attention and MLP variants: GPT-NeoX's partial rotary + parallel residual, GPT-J's
    # interleaved rotary, Qwen3's per-head q/k RMSNorm, ESM's rotary protein encoder, ConvBERT's
    # span-based dynamic convolution, Funnel's pooled sequence, XLNet's two-stream relative attention
    "gpt_neox": (
        "GPTNeoXModel",
        "GPTNeoXConfig",
        dict(_LLM, rotary_pct=0.25),
    ),
    "gptj": (
        "GPTJModel",
        "GPTJConfig",
        dict(n_embd=512, n_layer=4, n_head=8, rotary_dim=32, n_inner=1376, vocab_size=32000, n_positions=512),
    ),
    "qwen3": ("Qwen3Model", "Qwen3Config", dict(_LLM, num_key_value_heads=2, head_dim=64)),
    "esm": (
        "EsmModel",
        "EsmConfig",
        dict(_ENCODER, vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="rotary"),
    ),
    "convbert": ("ConvBertModel", "ConvBertConfig", dict(_ENCODER, embedding_size=384)),
    "funnel": (
        "FunnelBaseModel",
        "FunnelConfig",
        dict(block_sizes=[2, 2], d_model=384, n_head=6, d_inner=1536),
    ),
    "xlnet": ("XLNetModel", "XLNetConfig", dict(d_model=384, n_layer=4, n_head=6, d_inner=1536)),
    # Mixtral's sparse mixture of experts (router top-2 of 4 experts), StableLM's partial rotary with
    # LayerNorm, CodeGen's one qkv projection split in model-parallel groups, FNet's Fourier token
    # mixing (no attention, no mask input), Nystromformer's landmark attention (segment means,
    # iterative pseudo-inverse, a depthwise conv over the values)
    "mixtral": (
        "MixtralModel",
        "MixtralConfig",
        # the loop over experts with data-dependent token lists (the default, grouped_mm, does not export)
        dict(
            _LLM,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
        ),
    ),
    "stablelm": ("StableLmModel", "StableLmConfig", dict(_LLM, num_key_value_heads=2)),
    "codegen": (
        "CodeGenModel",
        "CodeGenConfig",
        dict(n_embd=512, n_layer=4, n_head=8, rotary_dim=32, n_inner=1376, vocab_size=32000, n_positions=512),
    ),
    "fnet": ("FNetModel", "FNetConfig", dict(hidden_size=384, num_hidden_layers=4, intermediate_size=1536)),
    "nystromformer": ("NystromformerModel", "NystromformerConfig", dict(_ENCODER, num_landmarks=64)),
    # more decoder variants: Phi-3's fused qkv and gate/up projections, OLMo's non-parametric
    # LayerNorm, Cohere's parallel block with a bias-free LayerNorm, StarCoder2's biased GELU MLP
    "phi3": ("Phi3Model", "Phi3Config", dict(_LLM, num_key_value_heads=2, pad_token_id=0)),
    "olmo": ("OlmoModel", "OlmoConfig", dict(_LLM, num_key_value_heads=2)),
    "cohere": ("CohereModel", "CohereConfig", dict(_LLM, num_key_value_heads=2)),
    "starcoder2": ("Starcoder2Model", "Starcoder2Config", dict(_LLM, num_key_value_heads=2)),
    # Gemma 2's alternating sliding-window / global layers and logit soft-capping, OLMo 2's q/k
    # RMSNorm after the projections, Persimmon's q/k LayerNorm with partial rotary, MPT's ALiBi,
    # BioGPT's scaled learned positions, XGLM's sinusoidal positions, BigBird's block-sparse
    # attention config (full attention at 128 tokens), CANINE's hashed character embeddings
    "gemma2": (
        "Gemma2Model",
        "Gemma2Config",
        dict(_LLM, num_key_value_heads=2, head_dim=64, sliding_window=64),
    ),
    "olmo2": ("Olmo2Model", "Olmo2Config", dict(_LLM, num_key_value_heads=2)),
    "persimmon": ("PersimmonModel", "PersimmonConfig", _LLM),
    "mpt": (
        "MptModel",
        "MptConfig",
        dict(d_model=512, n_heads=8, n_layers=4, vocab_size=32000, max_seq_len=512),
    ),
    "biogpt": ("BioGptModel", "BioGptConfig", dict(_ENCODER, vocab_size=32000)),
    "xglm": (
        "XGLMModel",
        "XGLMConfig",
        dict(d_model=384, num_layers=4, attention_heads=6, ffn_dim=1536, vocab_size=32000),
    ),
    "canine": ("CanineModel", "CanineConfig", dict(_ENCODER)),
    # Longformer's sliding-window + global attention, BigBird (full attention at 128 tokens),
    # DeBERTa (v1)'s disentangled relative attention
    "longformer": ("LongformerModel", "LongformerConfig", dict(_ENCODER, attention_window=64)),
    "big_bird": ("BigBirdModel", "BigBirdConfig", dict(_ENCODER)),
    "deberta": ("DebertaModel", "DebertaConfig", dict(_ENCODER)),
}
# Other tasks and inputs: segmentation heads (dict outputs, bilinear Resize, dilated convs), video
# (Conv3d; r2plus1d_18's (2+1)D factorisation), speech (Conv1d front ends, GroupNorm), Hugging Face
# vision models (MobileViT's unfold / fold into patches, SegFormer, ConvNeXt V2's GRN) and an
# encoder-decoder (BART: cross-attention, causal mask)
SEGMENTATION = ["lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50"]
VIDEO = ["r3d_18", "r2plus1d_18"]
HF_OTHER = {  # name -> (model class, config class, config arguments, output attribute, input shape)
    "whisper_encoder": (
        "WhisperModel",
        "WhisperConfig",
        dict(
            d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536, decoder_layers=1
        ),
        "last_hidden_state",
        (1, 80, 3000),  # 30 s of 80-bin log-mel frames
    ),
    "wav2vec2": (
        "Wav2Vec2Model",
        "Wav2Vec2Config",
        _ENCODER,
        "last_hidden_state",
        (1, 16000),  # 1 s of 16 kHz audio
    ),
    "segformer": ("SegformerForSemanticSegmentation", "SegformerConfig", {}, "logits", (1, 3, 224, 224)),
    "mobilevit": ("MobileViTModel", "MobileViTConfig", {}, "last_hidden_state", (1, 3, 256, 256)),
    "convnextv2": ("ConvNextV2Model", "ConvNextV2Config", {}, "pooler_output", (1, 3, 224, 224)),
    # conv-attention hybrid with BatchNorm'd linears; pooling as token mixer; relative position
    # bias; interpolated position embeddings; TF "same" padding
    "levit": ("LevitModel", "LevitConfig", {}, "pooler_output", (1, 3, 224, 224)),
    "poolformer": ("PoolFormerModel", "PoolFormerConfig", {}, "last_hidden_state", (1, 3, 224, 224)),
    "beit": (
        "BeitModel",
        "BeitConfig",
        dict(
            hidden_size=384,
            num_hidden_layers=4,
            num_attention_heads=6,
            intermediate_size=1536,
            use_relative_position_bias=True,  # off by default
        ),
        "last_hidden_state",
        (1, 3, 224, 224),
    ),
    "dinov2": (
        "Dinov2Model",
        "Dinov2Config",
        dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, image_size=224),
        "last_hidden_state",
        (1, 3, 224, 224),
    ),
    "mobilenet_v2_hf": ("MobileNetV2Model", "MobileNetV2Config", {}, "pooler_output", (1, 3, 224, 224)),
    # convolutional token embeddings and projections inside attention (CvT); spatial-reduction
    # attention, keys and values from a strided conv (PVT)
    "cvt": ("CvtModel", "CvtConfig", {}, "last_hidden_state", (1, 3, 224, 224)),
    "pvt": ("PvtModel", "PvtConfig", {}, "last_hidden_state", (1, 3, 224, 224)),
    # a ViT with detection tokens and interpolated position embeddings; TF "same" padding
    "yolos": (
        "YolosModel",
        "YolosConfig",
        dict(_ENCODER, image_size=[224, 224]),
        "last_hidden_state",
        (1, 3, 224, 224),
    ),
    "mobilenet_v1_hf": ("MobileNetV1Model", "MobileNetV1Config", {}, "pooler_output", (1, 3, 224, 224)),
    # BiT's weight-standardized convs (statistics of constant weights); FocalNet's focal
    # modulation (depthwise convs, gated aggregation); SigLIP's vision tower (attention pooling
    # head with a learned probe); DeiT's distillation token
    "bit": ("BitModel", "BitConfig", dict(layer_type="bottleneck"), "pooler_output", (1, 3, 224, 224)),
    "focalnet": ("FocalNetModel", "FocalNetConfig", {}, "pooler_output", (1, 3, 224, 224)),
    "siglip_vision": (
        "SiglipVisionModel",
        "SiglipVisionConfig",
        dict(_ENCODER, image_size=224, patch_size=16),
        "pooler_output",
        (1, 3, 224, 224),
    ),
    "deit": ("DeiTModel", "DeiTConfig", _ENCODER, "last_hidden_state", (1, 3, 224, 224)),
    # WavLM: wav2vec2's front end with gated relative position bias in every attention layer
    "wavlm": ("WavLMModel", "WavLMConfig", _ENCODER, "last_hidden_state", (1, 16000)),
    "hubert": ("HubertModel", "HubertConfig", _ENCODER, "last_hidden_state", (1, 16000)),
    # the Audio Spectrogram Transformer: a ViT over overlapping 16x16 patches of 512 frames x 128 bins
    "ast": ("ASTModel", "ASTConfig", dict(_ENCODER, max_length=512), "pooler_output", (1, 512, 128)),
    "swin_hf": ("SwinModel", "SwinConfig", {}, "pooler_output", (1, 3, 224, 224)),
    # MobileViTV2's separable linear attention, PVTv2's overlapping patch embeddings with a depthwise
    # conv in the MLP, Data2Vec-Audio's convolutional positions, UniSpeech's wav2vec2-style encoder
    "mobilevitv2": ("MobileViTV2Model", "MobileViTV2Config", {}, "pooler_output", (1, 3, 256, 256)),
    "pvt_v2": ("PvtV2Model", "PvtV2Config", {}, "last_hidden_state", (1, 3, 224, 224)),
    "data2vec_audio": (
        "Data2VecAudioModel",
        "Data2VecAudioConfig",
        _ENCODER,
        "last_hidden_state",
        (1, 16000),
    ),
    "unispeech": ("UniSpeechModel", "UniSpeechConfig", _ENCODER, "last_hidden_state", (1, 16000)),
    # CLIP's vision tower, DPT's depth head (reassembled ViT tokens, fusion blocks, upsampling),
    # Hiera's mask-unit attention, SwiftFormer's additive attention, VideoMAE's tubelet patches
    "clip_vision": (
        "CLIPVisionModel",
        "CLIPVisionConfig",
        dict(_ENCODER, image_size=224, patch_size=32),
        "pooler_output",
        (1, 3, 224, 224),
    ),
    "dpt": (
        "DPTForDepthEstimation",
        "DPTConfig",
        dict(_ENCODER, image_size=224, backbone_out_indices=[0, 1, 2, 3]),
        "predicted_depth",
        (1, 3, 224, 224),
    ),
    "hiera": ("HieraModel", "HieraConfig", {}, "pooler_output", (1, 3, 224, 224)),
    "swiftformer": ("SwiftFormerModel", "SwiftFormerConfig", {}, "last_hidden_state", (1, 3, 224, 224)),
    "videomae": (
        "VideoMAEModel",
        "VideoMAEConfig",
        dict(_ENCODER, num_frames=8, image_size=112),
        "last_hidden_state",
        (1, 8, 3, 112, 112),
    ),
}
SEQ2SEQ = ["bart"]
# torch's recurrent layers (ONNX LSTM / GRU): two bidirectional batch-first layers over 50 frames of
# 40 features and a linear head, the shape of a small speech or time-series model
RECURRENT = {"lstm": "LSTM", "gru": "GRU"}
MODELS = VISION + list(TEXT) + SEGMENTATION + VIDEO + list(HF_OTHER) + SEQ2SEQ + list(RECURRENT)


def torch_model(name: str):
    """``(module in eval mode, example inputs, input names)`` with seeded random weights."""
    import torch

    torch.manual_seed(0)
    if name in VISION:
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
        model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
        zoo._no_zero_layers(model)
        zoo._calibrate_batch_norm(model)
        size = 299 if name == "inception_v3" else 224
        return model, (torch.randn(1, 3, size, size),), ["input"]
    if name in SEGMENTATION or name in VIDEO:
        import torchvision

        if name in VIDEO:
            model, shape = getattr(torchvision.models.video, name)(weights=None), (1, 3, 8, 112, 112)
        else:  # the "out" head's logits (the aux head is off)
            model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
            model, shape = _output(model, key="out"), (1, 3, 224, 224)
        zoo._no_zero_layers(model)
        zoo._calibrate_batch_norm(model, shape, batch=4, rounds=1)
        return model.eval(), (torch.randn(*shape),), ["input"]
    if name in RECURRENT:
        return _recurrent(getattr(torch.nn, RECURRENT[name])).eval(), (torch.randn(1, 50, 40),), ["input"]
    import transformers

    if name in HF_OTHER:
        model_class, config_class, arguments, output, shape = HF_OTHER[name]
        inner = getattr(transformers, model_class)(getattr(transformers, config_class)(**arguments))
        if name == "whisper_encoder":
            inner = inner.get_encoder()
        model = _output(inner.eval(), attribute=output)
        if len(shape) == 4:  # their BatchNorms: MobileViT's output was ~1e-40 without
            zoo._calibrate_batch_norm(model, shape, batch=4, rounds=1)
        input_name = {2: "input_values", 3: "input_features"}.get(len(shape), "pixel_values")
        return model.eval(), (torch.randn(*shape),), [input_name]
    if name in SEQ2SEQ:
        config = transformers.BartConfig(
            d_model=512, encoder_layers=3, decoder_layers=3, encoder_ffn_dim=2048, decoder_ffn_dim=2048
        )
        model = _seq2seq(transformers.BartModel(config).eval())
        ids = torch.randint(0, 1000, (1, zoo.SEQ), dtype=torch.int64)
        mask = torch.ones(1, zoo.SEQ, dtype=torch.int64)
        decoder_ids = torch.randint(0, 1000, (1, 32), dtype=torch.int64)
        return model.eval(), (ids, mask, decoder_ids), ["input_ids", "attention_mask", "decoder_input_ids"]

    model_class, config_class, arguments = TEXT[name]
    config = getattr(transformers, config_class)(**arguments)
    inner = getattr(transformers, model_class)(config).eval()
    extra = {"use_cache": False} if "use_cache" in config.to_dict() else {}
    seq = 77 if name == "clip_text" else zoo.SEQ
    vocabulary = getattr(config, "vocab_size", 1000)  # CANINE reads Unicode code points: none
    ids = torch.randint(0, min(1000, vocabulary), (1, seq), dtype=torch.int64)  # ESM: 33
    wrapped = _last_hidden(inner, extra).eval()
    if "attention_mask" not in inspect.signature(inner.forward).parameters:  # FNet
        return wrapped, (ids,), ["input_ids"]
    return wrapped, (ids, torch.ones(1, seq, dtype=torch.int64)), ["input_ids", "attention_mask"]


def _last_hidden(model, extra: dict):
    """A text model's last hidden state from token ids and, where it takes one, an attention mask."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask=None):
            masked = {} if attention_mask is None else {"attention_mask": attention_mask}
            return self.model(input_ids=input_ids, **masked, **extra).last_hidden_state

    return LastHidden()


def _recurrent(layer_class):
    """Two bidirectional batch-first ``layer_class`` layers (40 -> 64 features) and a linear head."""
    import torch

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = layer_class(40, 64, num_layers=2, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(128, 10)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    return Recurrent()


def _output(model, key=None, attribute=None):
    """``model`` returning one tensor of its output: a dict entry (torchvision segmentation) or an
    attribute (a Hugging Face ``ModelOutput``)."""
    import torch

    class Output(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            out = self.model(x)
            return out[key] if key is not None else getattr(out, attribute)

    return Output()


def _seq2seq(model):
    """An encoder-decoder's last decoder hidden state, from token ids, mask and decoder ids."""
    import torch

    class Seq2Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
            ).last_hidden_state

    return Seq2Seq()


def check_one(name: str, exporter: str, cache: Path, runs: int) -> dict:
    """Export (cached), build, compare and time one model; the row as a dict."""
    import onnx
    import tvm

    from tvm_fusion import build
    from tvm_fusion.benchmark import interleaved_ms, ort_variant
    from tvm_fusion.targets import llvm_target

    row = {"model": name, "exporter": exporter}
    path = cache / f"{name}.{exporter}.onnx"
    if not path.exists():  # written whole or not at all: a reader never sees half a file
        cache.mkdir(parents=True, exist_ok=True)
        model, args, input_names = torch_model(name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".onnx", dir=cache)
        os.close(fd)
        try:
            zoo._torch_export(model, args, input_names, exporter, tmp)
            os.replace(tmp, path)
        except Exception as err:  # torch.onnx's failure, not ours: reported apart
            cause = err.__cause__ or err  # torch.onnx wraps it; its first line says what failed
            first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
            return {**row, "export_error": f"{type(cause).__name__}: {first}"[:300]}
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    model = onnx.load(str(path))
    feeds = zoo.feeds_for(model, TEXT[name][2].get("vocab_size", 1000) if name in TEXT else 1000)
    target = llvm_target()
    row["threads"] = int(target.attrs["num-cores"])  # ORT's and ours (TVM_NUM_THREADS: all cores)
    try:
        ort = ort_variant(model, feeds, row["threads"])
    except Exception as err:  # an export ORT rejects has no reference: ours is built, not checked
        ort = None
        row["reference_error"] = zoo._one_line(err)
    del model
    start = time.perf_counter()
    try:
        result = build(str(path), target, name=f"{name}.{exporter}", tuning_logs=None)
    except Exception as err:
        if ort is None:  # both reject the file: say both, the export is the likelier culprit
            reason = row.pop("reference_error")
            return {**row, "error": f"{zoo._one_line(err)} (ONNX Runtime rejects the file too: {reason})"}
        raise
    row.update(
        build_s=round(time.perf_counter() - start, 1), ops=result.summary.ops, kernels=result.summary.kernels
    )
    if ort is None:
        return row
    reference = np.asarray(ort.output)
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    row["rel_err"] = zoo.relative_error(vm, args, reference)
    if runs:
        row["ms_ort"], row["ms_ours"] = interleaved_ms([ort.run, lambda: vm["main"](*args)], runs)
    return row


def run_child(name: str, exporter: str, args) -> dict:
    command = [sys.executable, __file__, "--one", name, exporter, "--cache", str(args.cache)]
    command += ["--runs", str(args.runs)]
    try:
        proc = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"model": name, "exporter": exporter, "error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(ROW):
            try:
                return json.loads(line[len(ROW) :])
            except json.JSONDecodeError:
                break
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    reason = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
    return {"model": name, "exporter": exporter, "error": f"{reason}: {tail[-1][:300] if tail else ''}"}


def store_row(results: Path, row: dict) -> None:
    """Put ``row`` into the results file, replacing the same model and exporter's earlier row
    (a run of a few models keeps the others' rows), in the table's order; written atomically."""
    rows = json.loads(results.read_text()) if results.exists() else []
    rows = [r for r in rows if (r["model"], r["exporter"]) != (row["model"], row["exporter"])] + [row]
    known = MODELS + [r["model"] for r in rows if r["model"] not in MODELS]
    rows.sort(key=lambda r: (known.index(r["model"]), zoo.EXPORTERS.index(r["exporter"])))
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, results)


def write_report(rows: list[dict], md: Path, note: str = "") -> None:
    ratios = [r["ms_ours"] / r["ms_ort"] for r in rows if r.get("ms_ours") and r.get("ms_ort")]
    exported = [r for r in rows if "export_error" not in r and "reference_error" not in r]
    ok = sum(1 for r in exported if "error" not in r and r.get("rel_err", 1) <= zoo.REL_TOL)
    unexported = sum(1 for r in rows if "export_error" in r)
    unchecked = sum(1 for r in rows if "reference_error" in r)
    threads = next((r["threads"] for r in rows if r.get("threads")), None)
    lines = [
        "# Models outside the zoo",
        "",
        "Written by `scripts/more_models.py`: torchvision and Hugging Face models that are not in the "
        "issue's zoo list, exported with random weights by both torch exporters, built by tvm_fusion "
        "for this CPU (llvm, untuned) and checked against ONNX Runtime; ours and ORT timed side by side "
        f"in one process, interleaved ({threads or 'all'} threads each). The decoder LLMs use small configs "
        "(hidden 512, 4 layers, 8 heads, 2 key/value heads). The 'ops' column counts the Relax ops of the "
        "imported module, after the ONNX preparation (`tvm_fusion.onnx_prepare`). Single runs on this "
        "shared 2-core VM vary by ~10 % (r2plus1d_18: 1.04-1.12 TorchScript, 0.98-1.10 dynamo across runs). "
        "Which rows were measured again when, and why: the measurement history at the end.",
        "",
        f"**Summary:** llvm build + numerics within {zoo.REL_TOL:g} relative: **{ok}/{len(exported)}**"
        + (f" ({unexported} more not exported: torch.onnx failed)" if unexported else "")
        + (f" ({unchecked} more built but not checked: ONNX Runtime rejects the export)" if unchecked else "")
        + (f"; × ORT median {np.median(ratios):.2f}, max {max(ratios):.2f}." if ratios else "."),
        "",
        "| model | exporter | ops → kernels | build s | max rel err | ms ORT | ms ours | × ORT |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "export_error" in r:
            lines.append(
                f"| {r['model']} | {r['exporter']} | torch.onnx export failed: `{r['export_error']}` | | | | | |"
            )
            continue
        if "error" in r:
            lines.append(f"| {r['model']} | {r['exporter']} | failed: `{r['error']}` | | | | | |")
            continue
        if "reference_error" in r:
            lines.append(
                f"| {r['model']} | {r['exporter']} | {r['ops']} → {r['kernels']} | {r['build_s']:.1f} | "
                f"no reference: ONNX Runtime rejects the export: `{r['reference_error']}` | | | |"
            )
            continue
        ratio = r["ms_ours"] / r["ms_ort"] if r.get("ms_ours") and r.get("ms_ort") else None
        lines.append(
            f"| {r['model']} | {r['exporter']} | {r['ops']} → {r['kernels']} | {r['build_s']:.1f} | "
            f"{r['rel_err']:.1e} | {zoo._fmt(r.get('ms_ort'), '.2f')} | {zoo._fmt(r.get('ms_ours'), '.2f')} | "
            f"{zoo._fmt(ratio, '.2f')} |"
        )
    standing = [f"- {text}" for text in STANDING_NOTES]
    md.write_text("\n".join(lines + ["", "## Notes", "", *standing] + zoo.history_section(md, note)) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--exporters", help="comma-separated subset of: torchscript,dynamo")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--runs", type=int, default=30, help="timed runs of each side (0: no timing)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model and exporter")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "more_models.md")
    parser.add_argument("--report", action="store_true", help="only rewrite the table from the .json")
    parser.add_argument(
        "--note", default="", help="what this run measured again and why: a new history entry"
    )
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "EXPORTER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        try:
            row = check_one(*args.one, args.cache, args.runs)
        except Exception as err:  # one line for the table
            row = {"model": args.one[0], "exporter": args.one[1], "error": zoo._one_line(err)}
        print(ROW + json.dumps(row), flush=True)
        return 0
    results = args.out.with_suffix(".json")
    if args.report and not results.exists():
        parser.error(f"{results}: no results yet (run without --report first)")
    if not args.report:
        for name in zoo._select(args.models, MODELS, "model"):
            for exporter in zoo._select(args.exporters, zoo.EXPORTERS, "exporter"):
                row = run_child(name, exporter, args)
                print(json.dumps(row), flush=True)
                store_row(results, row)  # after every row: a stopped run keeps what it measured
    write_report(json.loads(results.read_text()), args.out, args.note)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
