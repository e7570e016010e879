"""The multimodal model: ViT image encoder, optional 1-D audio encoder, projectors and the
GPT backbone from ``agent/runtime/model.py``.

Contract: ``MMModel.encode(samples) -> list[Tensor]`` gives each sample's media
embeddings ``(media_tokens, llm_hidden)`` (an empty tensor for text-only samples), and
``MMModel.llm_loss(samples, embs, norm)`` returns ``sum of next-token losses / norm``
for those samples, where ``norm`` is the target count of the *whole* step's batch — so
losses of micro-batches (or of ranks) add up to the full batch's mean loss, which makes
pipelined, colocated and disaggregated steps equal to a plain step up to float rounding.
Parameters split into ``encoder_parameters()`` (encoders + projectors) and
``llm_parameters()`` (the GPT) so each side can run on its own quota or ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from agent.runtime.model import GPT, Block, GPTConfig
from agent.runtime.multimodal.data import Sample


def _full_attention(n: int, t: int, device: torch.device) -> torch.Tensor:
    # Encoders attend bidirectionally; the GPT Block is causal unless given a mask.
    return torch.ones(n, t, t, dtype=torch.bool, device=device)


class ViTEncoder(nn.Module):
    """Patchify, embed, transformer blocks (bidirectional), average-pool ``pool`` patches."""

    def __init__(self, size: int, patch: int, channels: int, pool: int, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.patch, self.pool = patch, pool
        self.n_patches = (size // patch) ** 2
        cfg = GPTConfig(vocab=1, seq_len=self.n_patches, layers=layers, hidden=hidden, heads=heads)
        self.embed = nn.Linear(channels * patch * patch, hidden)
        self.pos = nn.Parameter(torch.randn(self.n_patches, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (N, C, S, S) -> (N, P/pool, hidden)
        n, c, _, _ = images.shape
        p = self.patch
        x = images.unfold(2, p, p).unfold(3, p, p)  # (N, C, S/p, S/p, p, p)
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(n, self.n_patches, c * p * p)
        x = self.embed(x) + self.pos
        mask = _full_attention(n, self.n_patches, x.device)
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln(x)
        return x.view(n, self.n_patches // self.pool, self.pool, -1).mean(2)


class AudioEncoder(nn.Module):
    """1-D encoder over frames: frame embedding, bidirectional blocks, pool ``pool`` frames."""

    def __init__(self, frames: int, frame_dim: int, pool: int, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.frames, self.pool = frames, pool
        cfg = GPTConfig(vocab=1, seq_len=frames, layers=layers, hidden=hidden, heads=heads)
        self.embed = nn.Conv1d(frame_dim, hidden, kernel_size=3, padding=1)
        self.pos = nn.Parameter(torch.randn(frames, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # (N, F, D) -> (N, F/pool, hidden)
        n = audio.shape[0]
        x = self.embed(audio.transpose(1, 2)).transpose(1, 2) + self.pos
        mask = _full_attention(n, self.frames, x.device)
        for blk in self.blocks:
            x = blk(x, mask)
        x = self.ln(x)
        return x.view(n, self.frames // self.pool, self.pool, -1).mean(2)


class Projector(nn.Module):
    """Two-layer MLP from an encoder's width to the LLM's."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_out), nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MMModel(nn.Module):
    """Encoders + projectors + GPT; deterministic init from ``torch.manual_seed``."""

    def __init__(self, gpt_cfg: GPTConfig, mm: dict) -> None:
        super().__init__()
        img, enc, aud = mm["image"], mm["encoder"], mm["audio"]
        self.gpt = GPT(gpt_cfg)
        self.vit = ViTEncoder(img["size"], img["patch"], img["channels"], img["pool"], enc["layers"], enc["hidden"], enc["heads"])
        self.img_proj = Projector(enc["hidden"], gpt_cfg.hidden)
        self.audio = None
        if aud["enabled"]:
            self.audio = AudioEncoder(aud["frames"], aud["frame_dim"], aud["pool"], aud["layers"], aud["hidden"], aud["heads"])
            self.aud_proj = Projector(aud["hidden"], gpt_cfg.hidden)

    def encoder_parameters(self) -> list[nn.Parameter]:
        mods = [self.vit, self.img_proj] + ([self.audio, self.aud_proj] if self.audio is not None else [])
        return [p for m in mods for p in m.parameters()]

    def llm_parameters(self) -> list[nn.Parameter]:
        return list(self.gpt.parameters())

    def encode(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Media embeddings per sample, images first then audio; empty for text-only."""
        dev = self.gpt.head.weight.device
        hid = self.gpt.cfg.hidden
        imgs = [s.images for s in samples if s.meta.n_images]
        img_out = self.img_proj(self.vit(torch.cat(imgs).to(dev))) if imgs else None
        auds = [s.audio for s in samples if s.meta.n_audio]
        aud_out = self.aud_proj(self.audio(torch.cat(auds).to(dev))) if (auds and self.audio is not None) else None
        out, ii, ai = [], 0, 0
        for s in samples:
            parts = []
            if s.meta.n_images:
                parts.append(img_out[ii:ii + s.meta.n_images].reshape(-1, hid))
                ii += s.meta.n_images
            if s.meta.n_audio and aud_out is not None:
                parts.append(aud_out[ai:ai + s.meta.n_audio].reshape(-1, hid))
                ai += s.meta.n_audio
            out.append(torch.cat(parts) if parts else torch.zeros(0, hid, device=dev))
        return out

    def llm_loss(self, samples: list[Sample], embs: list[torch.Tensor], norm: float) -> torch.Tensor:
        """Sum of next-token losses of ``samples`` (text targets only) divided by ``norm``.
        Sequences are media then text, right-padded: causal attention keeps padding from
        touching real positions, so the batch composition does not change any loss."""
        gpt = self.gpt
        dev = gpt.head.weight.device
        if not samples:
            return torch.zeros((), device=dev)
        seqs, tgts = [], []
        for s, e in zip(samples, embs):
            text = s.text.to(dev)
            seqs.append(torch.cat([e, gpt.embed.tok(text)]))
            t = torch.full((e.shape[0] + text.shape[0],), -100, dtype=torch.long, device=dev)
            start = e.shape[0] - 1 if e.shape[0] else 0  # last media position predicts text[0]
            t[start:start + text.shape[0] - (0 if e.shape[0] else 1)] = text[(0 if e.shape[0] else 1):]
            tgts.append(t)
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        y = nn.utils.rnn.pad_sequence(tgts, batch_first=True, padding_value=-100)
        x = x + gpt.embed.pos(torch.arange(x.shape[1], device=dev))
        for blk in gpt.blocks:
            x = blk(x)
        logits = gpt.head(gpt.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum") / norm


def n_targets(samples: list[Sample]) -> int:
    """Next-token targets of ``samples`` (the ``norm`` of a batch's mean loss)."""
    return sum(s.meta.text_len - (0 if (s.meta.n_images or s.meta.n_audio) else 1) for s in samples)
