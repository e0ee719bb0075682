"""What a chunked data-parallel run executes, decided once by :mod:`chunked_dp.prepare` and handed
to every worker as it is."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Timing:
    """Emulated device time (``--emulate``): per layer, one micro-batch's forward and backward on
    the emulated GPU, and AdamW's rates on the host and on the device (parameters/s)."""

    layer_s: tuple[tuple[float, float], ...]
    host_adam_params_per_s: float
    device_adam_params_per_s: float


@dataclass(frozen=True)
class ChunkedSetup:
    chunk_size: int  # elements per chunk
    n_chunks: int
    n_block: int  # rCache blocks
    offload: bool  # chunks beyond ``device_chunks`` live (master, AdamW) in host memory
    device_chunks: int
    group: int  # micro-batches per pass (each pass gathers a layer's chunks once)
    predicted: dict = field(default_factory=dict)  # lane -> busy seconds of a step, and "step"
    reasons: str = ""  # why the search chose this
    timing: Timing | None = None  # under --emulate

    @property
    def chunks_on_device(self) -> int:
        return self.n_chunks if not self.offload else min(self.device_chunks, self.n_chunks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ChunkedSetup":
        timing = d.get("timing")
        if timing is not None:
            timing = Timing(tuple(tuple(t) for t in timing["layer_s"]), timing["host_adam_params_per_s"],
                            timing["device_adam_params_per_s"])
        return cls(**{**d, "timing": timing})
