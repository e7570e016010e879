"""Synthetic image(-audio)-text samples whose shape varies per sample and whose modality
mix follows a schedule over the run.

Contract: a sample is a pure function of ``(seed, sample_id, mix at the sample's step)``,
so every rank of a job can materialise any sample it is handed without shipping data,
and a reordered epoch sees exactly the same samples. Sample ``i`` belongs to step
``i // batch_size`` of the unreordered stream; that step sets its modality mix.

The task is learnable (so the loss falls): a sample has a hidden ``key``; its images are
noisy renderings of a per-key template, its audio a per-key waveform, and its text walks
``t[i+1] = (t[i] + 1 + key) mod vocab`` from a random start. The media tell the LLM the
key before the text does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.spec.multimodal import mix_at  # noqa: F401 - re-exported: the schedule's one definition


@dataclass(frozen=True)
class SampleMeta:
    """Shape of one sample; all a planner needs (pure data, no tensors)."""

    id: int
    n_images: int
    n_audio: int
    text_len: int
    key: int

    def media_tokens(self, per_image: int, per_audio: int) -> int:
        return self.n_images * per_image + self.n_audio * per_audio


@dataclass
class Sample:
    meta: SampleMeta
    images: torch.Tensor  # (n_images, C, S, S) float
    audio: torch.Tensor  # (n_audio, frames, frame_dim) float
    text: torch.Tensor  # (text_len,) int64


class SyntheticData:
    """Deterministic sample source for one job (``mm`` is a validated multimodal section)."""

    def __init__(self, mm: dict, vocab: int, seq_len: int, batch_size: int, seed: int) -> None:
        self.mm, self.vocab, self.seq_len, self.batch_size, self.seed = mm, vocab, seq_len, batch_size, seed
        img, aud, data = mm["image"], mm["audio"], mm["data"]
        self.per_image = (img["size"] // img["patch"]) ** 2 // img["pool"]
        self.per_audio = aud["frames"] // aud["pool"] if aud["enabled"] else 0
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        self.img_templates = torch.randn(data["keys"], img["channels"], img["size"], img["size"], generator=g)
        self.aud_templates = torch.randn(data["keys"], aud["frames"], aud["frame_dim"], generator=g)

    def _gen(self, sample_id: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + sample_id * 2_654_435_761) % (2**63))

    def meta(self, sample_id: int) -> SampleMeta:
        """Shape of sample ``sample_id``; cheap (no tensors beyond a few scalars)."""
        data, aud = self.mm["data"], self.mm["audio"]
        g = self._gen(sample_id)
        u = torch.rand(4, generator=g).tolist()
        p_img, p_aud = mix_at(self.mm["mix"], sample_id // self.batch_size)
        n_img = 1 + int(u[1] * data["max_images"]) if (u[0] < p_img and data["max_images"] > 0) else 0
        n_img = min(n_img, data["max_images"])
        n_aud = 0
        if aud["enabled"] and data["max_audio"] > 0 and u[2] < p_aud:
            n_aud = 1 + int(u[3] * data["max_audio"]) if data["max_audio"] > 1 else 1
            n_aud = min(n_aud, data["max_audio"])
        key = int(torch.randint(0, data["keys"], (1,), generator=g))
        text = int(torch.randint(data["min_text"], data["max_text"] + 1, (1,), generator=g))
        # Media take LLM positions; text gets what is left so every sample fits seq_len.
        room = self.seq_len - n_img * self.per_image - n_aud * self.per_audio
        return SampleMeta(sample_id, n_img, n_aud, max(2, min(text, room)), key)

    def sample(self, sample_id: int) -> Sample:
        """Materialise sample ``sample_id`` (same tensors on every call and every rank)."""
        m = self.meta(sample_id)
        g = self._gen(sample_id + 1_000_000_007)
        images = self.img_templates[m.key].expand(m.n_images, -1, -1, -1) + 0.5 * torch.randn(
            m.n_images, *self.img_templates.shape[1:], generator=g
        )
        audio = self.aud_templates[m.key].expand(m.n_audio, -1, -1) + 0.5 * torch.randn(
            m.n_audio, *self.aud_templates.shape[1:], generator=g
        )
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        text = (start + torch.arange(m.text_len) * (1 + m.key)) % self.vocab
        return Sample(m, images.contiguous(), audio.contiguous(), text.long())
