"""HiFT vocoder hyper-parameters (released CosyVoice2-0.5B values as defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


def _three_dilations() -> tuple[tuple[int, ...], ...]:
    return ((1, 3, 5), (1, 3, 5), (1, 3, 5))


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = field(default_factory=_three_dilations)
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = field(default_factory=_three_dilations)
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame (480 at the released configuration)."""
        rate = self.istft_hop
        for u in self.upsample_rates:
            rate *= u
        return rate

    @property
    def num_harmonic_channels(self) -> int:
        """Fundamental plus overtones."""
        return self.nb_harmonics + 1

    @classmethod
    def from_dict(cls, args: Mapping[str, Any]) -> "HiFTConfig":
        """Build from upstream HiFTGenerator constructor arguments (the parity harness `hift` section)."""
        f0 = args.get("f0_predictor", {})
        if f0.get("num_class", 1) != 1:
            raise ValueError(f"f0 predictor num_class must be 1, got {f0['num_class']}")
        istft = args.get("istft_params", {})
        defaults = cls()
        known = {name for name in asdict(defaults)} - {"istft_n_fft", "istft_hop", "f0_cond_channels"}
        plain = {k: _as_tuple(v) for k, v in args.items() if k in known}
        return cls(
            **plain,
            istft_n_fft=int(istft.get("n_fft", defaults.istft_n_fft)),
            istft_hop=int(istft.get("hop_len", defaults.istft_hop)),
            f0_cond_channels=int(f0.get("cond_channels", defaults.f0_cond_channels)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Inverse of `from_dict` (upstream argument names, JSON-friendly)."""
        out = asdict(self)
        out["istft_params"] = {"n_fft": out.pop("istft_n_fft"), "hop_len": out.pop("istft_hop")}
        out["f0_predictor"] = {"num_class": 1, "in_channels": self.in_channels,
                               "cond_channels": out.pop("f0_cond_channels")}
        return {k: _as_list(v) for k, v in out.items()}


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _as_list(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_list(v) for v in value]
    return value
