"""What defines a bench run: BenchConfig (the options, their checks, the report's parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chunkattn_client.bench.workload import Lengths, SequenceSpec, WorkloadError
from chunkattn_client.dataplane import SETTINGS as DATA_PLANES
from chunkattn_client.limits import MAX_BLOCK_SPACES, route_problem

TRANSPORTS = ("unary", "stream")
WORKLOADS = ("sequences", "engine")  # one model runner per sequence; or serving engines that batch them
APIS = ("blocks", "sequence")  # how an engine addresses KV: its own block space, or the server's sequences


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a run (the report prints it as the run's parameters)."""

    target: str
    concurrency: int = 1
    rate: float | None = None  # sequences per second (open loop); None: closed loop
    max_concurrency: int = 256  # open loop: sequences in flight at most
    prompt: Lengths = field(default_factory=lambda: Lengths(128, 128))
    output: Lengths = field(default_factory=lambda: Lengths(32, 32))
    trace: tuple[SequenceSpec, ...] | None = None
    trace_path: str | None = None
    layers: str = "all"
    prefill_chunk: int = 0  # tokens per prefill piece; 0: the whole prompt in one call per layer
    transport: str = "unary"
    data_plane: str = "auto"  # --data-plane: "auto", "grpc" or "zmq" (the client's data_plane)
    data_plane_used: str = ""  # what the calls went over ("grpc", "zmq:tcp", "zmq:ipc"), once the client chose
    dtype: str = "float32"
    warmup_s: float = 0.0
    duration_s: float | None = None
    sequences: int | None = None
    seed: int = 0
    verify: int = 0
    timeout_s: float = 60.0
    max_errors: int = 100
    metrics_url: str | None = None
    route: str | None = None  # every sequence's x-chunkattn-route; None: each sequence's id
    spec_tokens: int = 0  # speculative decoding: drafts per verify call (0: plain one-token decode steps)
    accept_rate: float = 0.7  # the probability that each draft is accepted (while every earlier one was)
    # The engine workload (docs/bench.md, "The engine workload"): --engines serving engines, each scheduling its
    # requests as vLLM does; concurrency and rate are per engine, sequences (requests) over all of them.
    workload: str = "sequences"
    engines: int = 1
    api: str = "blocks"
    max_num_batched_tokens: int = 2048  # vLLM's token budget per step
    max_num_seqs: int = 256  # vLLM's most requests running at once
    async_scheduling: bool = False  # vLLM's async scheduling (its default on GPUs; its CPU platform turns it off)
    kv_blocks: int | None = None  # blocks of each engine's space (None: what max_num_seqs requests need)
    model_step_ms: float = 0.0  # the model's non-attention time per step, slept before layers' calls (>= 2 ms lumps)

    def check(self) -> None:
        """Raise WorkloadError naming the first option that cannot work."""
        if self.duration_s is None and self.sequences is None and self.trace is None:
            raise WorkloadError("say how long to run: --duration SECONDS or --sequences N (or a --trace)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise WorkloadError(f"--duration must be > 0, got {self.duration_s}")
        if self.sequences is not None and self.sequences < 1:
            raise WorkloadError(f"--sequences must be >= 1, got {self.sequences}")
        if self.concurrency < 1 or self.max_concurrency < 1:
            raise WorkloadError("--concurrency and --max-concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise WorkloadError(f"--rate must be > 0 sequences per second, got {self.rate}")
        if self.prefill_chunk < 0:
            raise WorkloadError(f"--prefill-chunk must be >= 0 (0: whole prompt), got {self.prefill_chunk}")
        if self.route is not None and (problem := route_problem(self.route)):
            raise WorkloadError(f"--route: {problem}")
        if self.transport not in TRANSPORTS:
            raise WorkloadError(f"--transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.data_plane not in DATA_PLANES:
            raise WorkloadError(f"--data-plane must be one of {DATA_PLANES}, got {self.data_plane!r}")
        if self.spec_tokens < 0 or not 0 <= self.accept_rate <= 1:
            raise WorkloadError(
                f"--spec-tokens must be >= 0 and --accept-rate in [0, 1], got {self.spec_tokens} and {self.accept_rate}"
            )
        if self.workload not in WORKLOADS:
            raise WorkloadError(f"--workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "engine":
            self._check_engine()
        else:
            engine_flags = {
                "--engines": self.engines != 1,
                "--api": self.api != "blocks",
                "--kv-blocks": self.kv_blocks is not None,
                "--async-scheduling": self.async_scheduling,
                "--max-num-batched-tokens": self.max_num_batched_tokens != 2048,
                "--max-num-seqs": self.max_num_seqs != 256,
                "--model-step-ms": self.model_step_ms != 0,
            }
            if given := [flag for flag, set_ in engine_flags.items() if set_]:
                raise WorkloadError(f"{', '.join(given)}: the engine workload's, add --workload engine")
        if self.warmup_s < 0 or self.verify < 0 or self.timeout_s <= 0 or self.max_errors < 1:
            raise WorkloadError("--warmup and --verify must be >= 0, --timeout > 0 and --max-errors >= 1")

    def _check_engine(self) -> None:
        if not 1 <= self.engines <= MAX_BLOCK_SPACES:
            raise WorkloadError(
                f"--engines must be 1 to {MAX_BLOCK_SPACES} (a tenant holds at most {MAX_BLOCK_SPACES} block spaces"
                f" on a server, one per engine), got {self.engines}"
            )
        if self.api not in APIS:
            raise WorkloadError(f"--api must be one of {APIS}, got {self.api!r}")
        if self.max_num_batched_tokens < 1:
            raise WorkloadError(
                "--max-num-batched-tokens is an engine step's token budget: at least 1 token, got"
                f" {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise WorkloadError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise WorkloadError(f"--kv-blocks must be >= 2 (block 0 is the engine's null block), got {self.kv_blocks}")
        if self.model_step_ms < 0:
            raise WorkloadError(f"--model-step-ms must be >= 0, got {self.model_step_ms}")
        if self.max_concurrency != 256:
            raise WorkloadError(
                "--max-concurrency is the sequences workload's: an engine's open loop queues every arrival (its"
                " --max-num-seqs run at once)"
            )
        if self.spec_tokens or self.prefill_chunk:
            raise WorkloadError(
                "--spec-tokens and --prefill-chunk are the sequences workload's: an engine chunks prefills to its"
                " --max-num-batched-tokens"
            )
        if self.output.low < 1:
            raise WorkloadError(f"--output-len: an engine's request generates at least 1 token, got {self.output}")
        if self.trace and min(s.output_len for s in self.trace) < 1:
            raise WorkloadError(
                f"the trace {self.trace_path}: an engine's request generates at least 1 token (output_len >= 1)"
            )

    def max_sequences(self) -> int | None:
        """The measured phase's sequence count: --sequences, else one pass over a trace without --duration."""
        if self.sequences is not None:
            return self.sequences
        if self.trace is not None and self.duration_s is None:
            return len(self.trace)
        return None

    def params(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mode": (f"open loop, {self.rate}/s" if self.rate else f"closed loop, concurrency {self.concurrency}")
            + (
                f" per engine, {self.engines} engine{'s' if self.engines > 1 else ''}"
                if self.workload == "engine"
                else ""
            ),
            "concurrency": None if self.rate else self.concurrency,
            "rate": self.rate,
            "max_concurrency": self.max_concurrency if self.rate and self.workload != "engine" else None,
            "prompt_len": f"trace {self.trace_path}" if self.trace else str(self.prompt),
            "output_len": f"trace {self.trace_path}" if self.trace else str(self.output),
            "layers": self.layers,
            "prefill_chunk": self.prefill_chunk,
            "transport": self.transport,
            "data_plane": self.data_plane_used or self.data_plane,
            "dtype": self.dtype,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "sequences": self.max_sequences(),
            "seed": self.seed,
            "verify": self.verify,
            "timeout_s": self.timeout_s,
            "spec_tokens": self.spec_tokens,
            "accept_rate": self.accept_rate if self.spec_tokens else None,
            "workload": self.workload,
            **(
                {
                    "engines": self.engines,
                    "api": self.api,
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "max_num_seqs": self.max_num_seqs,
                    "async_scheduling": self.async_scheduling,
                    "kv_blocks": self.kv_blocks,
                    "model_step_ms": self.model_step_ms,
                }
                if self.workload == "engine"
                else {}
            ),
        }
