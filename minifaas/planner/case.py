"""A planning case: the hardware, the link and the workload the throughput model is solved for.

A TOML (or JSON) file (``load_case``, ``name`` optional) plans any deployment:

    n_prfaas = 4              # PrfaaS instances
    n_pd = 8                  # local PD instances, N_p + N_d
    n_homogeneous = 12        # instances of the homogeneous-PD baseline
    link_gbps = 100.0
    output_tokens = 1024
    [lengths]                 # a truncated log-normal, or trace = "azure-code": a shipped trace's name or a
    mu = 9.90                 # Mooncake JSONL / Azure CSV file relative to the case file (its input lengths,
    sigma = 1.00              # times length_scale if given)
    low = 128
    high = 128000
    [prfaas]                  # a prefill profile (profile.py); [pd_prefill] too; [decode] a decode profile
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from minifaas.planner.lengths import LengthDistribution
from minifaas.planner.profile import (
    DecodeProfile,
    PrefillProfile,
    check_finite,
    checked_table,
    decode_from_dict,
    load_table,
    prefill_from_dict,
)
from minifaas.traces import SHIPPED_TRACES, read_trace


@dataclass(frozen=True)
class PlanCase:
    name: str
    prfaas: PrefillProfile  # one PrfaaS-cluster instance
    pd_prefill: PrefillProfile  # one local PD-cluster instance doing prefill
    decode: DecodeProfile  # one local PD-cluster instance doing decode
    lengths: LengthDistribution  # uncached input length L
    output_tokens: float  # mean output length L_out
    n_prfaas: int
    n_pd: int  # N_p + N_d
    n_homogeneous: int  # instances of the homogeneous-PD baseline, all of pd_prefill's hardware
    link_gbps: float  # PrfaaS egress bandwidth B_out

    def __post_init__(self) -> None:
        if self.n_prfaas < 0 or self.n_pd < 2 or self.n_homogeneous < 2:
            raise ValueError(f"{self.name}: need n_prfaas >= 0, n_pd >= 2, n_homogeneous >= 2")
        if self.link_gbps <= 0 or self.output_tokens <= 0:
            raise ValueError(f"{self.name}: link_gbps and output_tokens must be > 0")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8

    @property
    def gpus(self) -> int:
        return self.n_prfaas * self.prfaas.gpus_per_instance + self.n_pd * self.decode.gpus_per_instance

    def with_overrides(self, **changes: Any) -> PlanCase:
        """A copy with some inputs replaced (flags on the command line, sweeps in studies)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def with_kv(self, bytes_per_token: float | None, fixed_bytes: float | None) -> PlanCase:
        """The same case with another model's KV sizes on both prefill clusters (e.g. a dense model's)."""
        kv = {"kv_bytes_per_token": bytes_per_token, "kv_fixed_bytes": fixed_bytes}
        kv = {k: v for k, v in kv.items() if v is not None}
        if not kv:
            return self
        return replace(self, prfaas=replace(self.prfaas, **kv), pd_prefill=replace(self.pd_prefill, **kv))


def case_from_dict(data: dict[str, Any], base_dir: Path = Path(".")) -> PlanCase:
    spec = data["lengths"]
    if "trace" in spec:
        source = spec["trace"] if spec["trace"] in SHIPPED_TRACES else base_dir / spec["trace"]
        trace = read_trace(source, length_scale=float(spec.get("length_scale", 1.0)))
        lengths = LengthDistribution.empirical(str(spec["trace"]), trace.input_tokens)
    else:
        lengths = LengthDistribution.lognormal(
            float(spec["mu"]), float(spec["sigma"]), float(spec["low"]), float(spec["high"])
        )
    return PlanCase(
        name=str(data.get("name", "custom")),
        prfaas=prefill_from_dict(data["prfaas"]),
        pd_prefill=prefill_from_dict(data["pd_prefill"]),
        decode=decode_from_dict(data["decode"]),
        lengths=lengths,
        output_tokens=float(data["output_tokens"]),
        n_prfaas=int(data["n_prfaas"]),
        n_pd=int(data["n_pd"]),
        n_homogeneous=int(data["n_homogeneous"]),
        link_gbps=float(data["link_gbps"]),
    )


CASE_KEYS = ("name", "n_prfaas", "n_pd", "n_homogeneous", "link_gbps", "output_tokens", "lengths", "prfaas",
             "pd_prefill", "decode")  # fmt: skip
PROFILE_TABLES = {"prfaas": PrefillProfile, "pd_prefill": PrefillProfile, "decode": DecodeProfile}
LENGTH_KEYS = {"trace": ("trace", "length_scale"), "lognormal": ("mu", "sigma", "low", "high")}


def _checked_settings(path: Path, data: dict[str, Any]) -> None:
    """ValueError naming the setting unless every table of the case is a table with only the settings it reads,
    and every number in the case is finite."""
    for key, value in data.items():
        if key == "lengths":
            form = "trace" if isinstance(value, dict) and "trace" in value else "lognormal"
            checked_table(path, key, value, LENGTH_KEYS[form])
        elif key in PROFILE_TABLES:
            checked_table(path, key, value, tuple(f.name for f in fields(PROFILE_TABLES[key])))
        else:
            check_finite(path, key, value)


def load_case(path: str | Path) -> PlanCase:
    """A case file's plan case; a file that cannot be read is a ValueError naming it and what is wrong."""
    path = Path(path)
    data = load_table(path, "case", "a table of settings")
    if unknown := sorted(set(data) - set(CASE_KEYS)):
        raise ValueError(f"{path}: unknown settings {unknown} (known: {', '.join(CASE_KEYS)})")
    _checked_settings(path, data)
    try:
        return case_from_dict(data, path.parent)
    except KeyError as e:
        raise ValueError(f"{path}: no {e.args[0]!r}") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: {e}") from None
