"""SpectrumKV: per-token mixed-precision KV cache payloads for handing a prompt's KV from prefill to decode.

Plain torch and the model config only (no model code): `layout` (a model's KV cache rows per token and layer),
`importance` (which prompt tokens matter: attention mass from the last prompt queries, or position only),
`allocation` (a precision tier per token under a byte budget), `quant` (symmetric absmax INT8/INT4 per
token and head), `payload` (the versioned packed payload, written and read layer by layer), `transfer`
(the payload over torch.distributed), `probe` (whether a model tolerates INT4 KV, cached per model).
See docs/spectrumkv.md.
"""
