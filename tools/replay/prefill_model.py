"""The prefill-time model of `kvtier replay --engine sim`, calibrated on the real tiny engine.

For a request with `new` tokens to compute on top of `cached` tokens already in the paged
cache (vLLM's local prefix hit plus what the connector loaded), of which `loaded[kind]`
came from a kvtier tier of that kind:

    ttft_s = t0 + a * new + b * new * (cached + new / 2) + sum_kind h[kind] * loaded[kind]

`t0` is the fixed cost of a step (scheduling, sampling, lookup), `a` the per-token cost of
the MLPs and projections, `b` attention (each new token attends to everything before it),
`h[kind]` the cost per token of bringing KV in from that tier (read, verify, scatter). The
response then streams `out` tokens at `decode_s` each; decode steps ride along with other
requests' prefills (continuous batching), so they do not occupy the instance.

`fit(points)` estimates the coefficients by least squares (non-negative) from measurements
taken by `tools.replay.calibrate` on the real engine; `Calibration.load()` reads the file
shipped in `tools/replay/calibration.json` (or another one) and says where it came from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvtier.store.base.errors import KVTierError

DEFAULT_PATH = Path(__file__).with_name("calibration.json")
KINDS = ("mooncake", "nvme", "sharedfs")


class CalibrationError(KVTierError):
    """A calibration file is missing or malformed."""


@dataclass
class PrefillModel:
    t0_s: float
    a_s: float                    # per new token
    b_s: float                    # per new token per token attended
    load_s: dict[str, float]      # per loaded token, by tier kind
    decode_s: float               # per generated token after the first

    def ttft(self, new: int, cached: int, loaded: dict[str, int] | None = None) -> float:
        t = self.t0_s + self.a_s * new + self.b_s * new * (cached + new / 2)
        for kind, n in (loaded or {}).items():
            t += self.load_s.get(kind, max(self.load_s.values(), default=0.0)) * n
        return t

    def describe(self) -> str:
        loads = ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in self.load_s.items())
        return (f"ttft = {self.t0_s * 1e3:.1f} ms + {self.a_s * 1e6:.1f} us x new + "
                f"{self.b_s * 1e9:.3f} ns x new x (cached + new/2) + per loaded token "
                f"({loads}); decode {self.decode_s * 1e3:.1f} ms/token")


@dataclass
class Calibration:
    model: PrefillModel
    source: str
    info: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None = None) -> "Calibration":
        path = Path(path or DEFAULT_PATH)
        try:
            data = json.loads(path.read_text())
            m = data["model"]
            model = PrefillModel(float(m["t0_s"]), float(m["a_s"]), float(m["b_s"]),
                                 {k: float(v) for k, v in m["load_s"].items()},
                                 float(m["decode_s"]))
        except FileNotFoundError:
            raise CalibrationError(f"{path}: no calibration file; run `kvtier replay "
                                   "--calibrate` to measure one") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CalibrationError(f"{path}: malformed calibration ({type(e).__name__}: "
                                   f"{e}); run `kvtier replay --calibrate` again") from None
        return cls(model, str(path), {k: v for k, v in data.items() if k != "model"})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({**self.info, "model": asdict(self.model)}, indent=2))


def fit(points: dict) -> PrefillModel:
    """Coefficients from measured points: `compute` rows (new, cached, seconds) with nothing
    loaded, `load[kind]` rows (new, loaded, seconds), `decode_s` a number."""
    rows = np.array(points["compute"], dtype=np.float64)
    new, cached, secs = rows[:, 0], rows[:, 1], rows[:, 2]
    x = np.stack([np.ones_like(new), new, new * (cached + new / 2)], axis=1)
    coef = _nnls(x, secs)
    base = PrefillModel(*coef, load_s={}, decode_s=float(points.get("decode_s", 0.0)))
    # the same request served from the local prefix cache, measured when it was (else the
    # fitted model): the difference is what bringing the prefix in from the tier costs
    local = {(int(n), int(c)): float(t) for n, c, t in rows}
    for kind, load_rows in points.get("load", {}).items():
        per = [(s - local.get((int(n), int(c)), base.ttft(int(n), int(c)))) / c
               for n, c, s in load_rows if c > 0]
        base.load_s[kind] = max(0.0, float(np.median(per))) if per else 0.0
    if "nvme" not in base.load_s and "sharedfs" in base.load_s:
        base.load_s["nvme"] = base.load_s["sharedfs"]  # both local disks here; see README
    return base


def _nnls(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with non-negative coefficients (drop a negative one, refit)."""
    active = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            out = [0.0] * x.shape[1]
            for j, v in zip(active, sol):
                out[j] = max(0.0, float(v))
            return out
        active.pop(int(np.argmin(sol)))
