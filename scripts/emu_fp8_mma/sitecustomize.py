"""The numerics of an fp8-MMA decode attention (scripts/fp8_mma_tile.py), emulated in the
torch reference backend, for ``tokenloom eval`` on the CPU (session 28):

    TL_EMU=qp PYTHONPATH=scripts/emu_fp8_mma tokenloom eval --kv-cache-dtype fp8 \
        --dtype float32 --attention torch --device cpu

``TL_EMU`` contains ``q``: each query row (token, head) rounded to e4m3 with its absmax
scale; ``p``: the probabilities times the value's per-token scale rounded to e4m3, with a
scale per query row (its max at 448), before the product with the raw fp8 values; ``t``
(session 29, instead of ``p``): the shipped kernel's rounding (``decode_fp8_mma.py``), in
tiles of 128 tokens (``TL_EMU_TILE``: another size; session 52's fp8-MMA prefill takes
64): p relative to the tile's own maximum per query row, times the value
scales over their largest in the tile times 448, rounded to e4m3; any other value (e.g.
``x``): the emulated computation without either rounding. Python
imports ``sitecustomize`` at start-up in every process, the engine's included; without
``TL_EMU`` nothing is patched.
"""

import os

if os.environ.get("TL_EMU"):
    import torch

    from tokenloom.plugins.attention import kv_quant, torch_backend

    FP8 = torch.float8_e4m3fn
    modes = os.environ["TL_EMU"]

    def _round_rows(x):  # e4m3 with a scale per last-dim row, back to float32
        amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
        s = amax / 448.0
        return (x / s).clamp(-448, 448).to(FP8).float() * s

    def _round_tiles(scores, m, vs, tile=128):
        """p * v_scale as decode_fp8_mma rounds it, over the row maximum ``m``."""
        h, tq, s = scores.shape
        pad = (-s) % tile
        sc = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
        sc = sc.view(h, tq, -1, tile)
        vt = torch.nn.functional.pad(vs.expand(h, tq, s), (0, pad)).view(h, tq, -1, tile)
        tmax = sc.amax(-1, keepdim=True)
        finite = torch.isfinite(tmax)
        tmax0 = torch.where(finite, tmax, torch.zeros_like(tmax))
        lift = 448.0 / vt.amax(-1, keepdim=True).clamp(min=1e-30)
        p8 = (torch.exp(sc - tmax0) * vt * lift).clamp(max=448).to(FP8).float() / lift
        p8 = torch.where(finite, p8 * torch.exp(tmax0 - m[..., None]), torch.zeros_like(p8))
        return p8.view(h, tq, -1)[..., :s]

    def _attend(self, q, k_cache, v_cache, block_table, seq_len, scale):
        if not kv_quant.is_quantized(k_cache.dtype):
            raise RuntimeError("emulation expects a quantized cache")
        nb = (seq_len + k_cache.shape[1] - 1) // k_cache.shape[1]
        blocks = block_table[:nb].long()

        def raw(cache):
            data = cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len].float()
            scales = kv_quant.scales_of(cache)[blocks].reshape(-1, cache.shape[2])[:seq_len]
            return data, scales  # [S, Hkv, D], [S, Hkv]

        kd, ks = raw(k_cache)
        vd, vs = raw(v_cache)
        g = self.group
        kd, ks, vd, vs = (t.repeat_interleave(g, dim=1) for t in (kd, ks, vd, vs))
        qf = q.float()  # [Tq, H, D]
        if "q" in modes:
            qf = _round_rows(qf)
        scores = torch.einsum("qhd,shd->hqs", qf, kd) * ks.t()[:, None, :] * scale  # [H, Tq, S]
        tq = q.shape[0]
        mask = torch_backend.causal_mask(tq, seq_len, q.device)  # [Tq, S] additive or bool
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)  # [H, Tq, S]
        denom = p.sum(dim=-1, keepdim=True)
        pv = p * vs.t()[:, None, :]  # the value's per-token scale folded into P
        if "p" in modes:
            pv = _round_rows(pv)
        if "t" in modes:
            tile = int(os.environ.get("TL_EMU_TILE", "128"))
            pv = _round_tiles(scores, m, vs.t()[:, None, :], tile)
        out = torch.einsum("hqs,shd->hqd", pv, vd) / denom
        return out.transpose(0, 1).to(q.dtype)

    torch_backend.TorchAttention._attend = _attend
