"""A cost model of gradspec's exact (fp64) path per sample: FLOPs, bytes and predicted seconds per stage.

    python -m benchmarks.gpu.cost_model --quick --out /tmp/cm          # rates measured on this machine
    python -m benchmarks.gpu.cost_model --device cuda --out $OUT       # on a GPU (the suite runs it too)
    python -m benchmarks.gpu.cost_model --rates gpu_out/results.json   # a GPU suite's rates (an H200's), anywhere

Every figure here is a PREDICTION: the work each stage does, counted from the model's shape, divided
by per-operation rates measured on the machine at hand (measure_rates). benchmarks/gpu/gpu_suite.py
prints the prediction beside its measurement, so a GPU run tests the model as well as the code.

Stages per sample (one sample of T tokens, R of them the response; a batch of `batch` samples):

- floor: forward and input-gradient backward in the model's dtype, no weight gradients; the LM head
  at the response positions only (as the engine runs it).
- grams: fp64 Grams on the compute device. Core path (a module whose min(d_in, d_out) > T): X X^T once
  per scored input (q, k, v share one; gate, up share one), D D^T per module (T x T, lower triangle),
  and <D D^T, X X^T>. Materialised path (min(d_in, d_out) <= T, the engine's rule): G = D^T X
  (d_out x d_in) and the Gram of its smaller side (a full GEMM, as the engine forms it).
- cores: the eigen stage. Core path: a Cholesky of B = X X^T per scored input, L^T A L by two
  GEMMs and a values-only symmetric eigensolve at n = T per module. Materialised path: one
  eigensolve at n = min(d_in, d_out) per module.
- copies: the Grams the eigen stage reads, device to host, where that stage runs on the host.

Mixture of experts (a shape with num_experts or num_local_experts): the router is one dense part
(hidden -> E) like the others. Each (sample, expert) pair with n routed tokens is a segment, and a
segment takes a dense sample's path at n tokens, per expert: gate and up share one input (the
expert's tokens), down reads the expert's intermediate activations. n is an ASSUMPTION: uniform
routing, each of a sample's T tokens to k experts spread evenly, so each reached expert gets
k T / E tokens and all E are reached once k T >= E (routing). Real routing is uneven: a few longer
segments cost more than many short ones (n^3 eigensolves), so the prediction is optimistic there.
The floor's expert GEMMs are timed at the dense GEMM rate, though each runs over an expert's few
rows (slower: not counted). Biases (gpt-oss) are neither scored nor counted.

FLOP conventions (exact, tested in tests/benchmarks/test_cost_model.py):
- GEMM (m x k) @ (k x n): 2 m n k.
- SYRK of a T x d matrix (the lower triangle of Y Y^T, diagonal included): T (T + 1) d.
- <A, B> of two T x T matrices: 2 T^2.
- Cholesky (potrf) at n: n^3 / 3.   Values-only symmetric eigensolve at n: 4 n^3 / 3 (reported;
  its time is measured, not derived from FLOPs).
- floor: 2 P T forward + 2 P T input-gradient backward (P: the weights of the decoder layers'
  linear modules a token passes through; MoE: attention, router, its k experts and any shared
  experts), attention 2 T^2 a per layer forward and 4 T^2 a backward (a = heads x head_dim; causal:
  half of QK^T and PV's 4 T^2 a; every layer full, gpt-oss's sliding-window layers too), and the
  LM head 2 h V R forward + 2 h V R backward.
- a training step (for comparison): the floor plus weight gradients, 2 P T + 2 h V R.

Time: compute stages are FLOPs / the measured rate of their operation (bytes are reported, not
timed: every stage is taken as compute-bound); copies are bytes / the measured device-to-host
bandwidth. Totals: "serial" is the sum of the stages (score() on one batch). "overlapped" assumes
the host's eigen work of one batch runs beside the device's next batch (submit() back to back) and
the copies stay on the device's side (to_host waits for them): max(device side, host side). On the
CPU the same cores do everything, so overlapped = serial. On a GPU the engine's measured dispatch
places each eigen stage (core, gram) on the host or the device: the "best" prediction takes, per
stage, the placement this model predicts faster.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.common import SHAPES

# Scored module sets, of the modules a shape has (an MoE layer: router and experts; gate, up and
# down only where it has shared experts); which modules read one input is Linear.input.
MODULE_SETS = {"attn": ("q", "k", "v", "o"),
               "all": ("q", "k", "v", "o", "gate", "up", "down", "router", "expert_gate", "expert_up", "expert_down")}
SYEVD_SIZES = (32, 64, 128, 256, 512, 1024)
QUICK_SYEVD_SIZES = (32, 64, 128, 256, 512)  # 32: Qwen3-30B-A3B's expert segments at T = 512
PREDICTION = "prediction (cost model), not a measurement"
UNIFORM_ROUTING = "uniform routing assumed: k T / E tokens of a sample per expert, all E reached once k T >= E"
# Prediction-only MoE shapes (config.json on the Hub, key names as there), beside common.SHAPES' dense ones.
MOE_SHAPES = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        num_experts=128, num_experts_per_tok=8, vocab_size=151936)),
    # gate and up interleaved in one gate_up_proj, with biases (not scored; their FLOPs left out)
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                    num_local_experts=32, num_experts_per_tok=4, vocab_size=201088)),
}


# ----------------------------------------------------------------------------- shapes and work


@dataclass(frozen=True)
class Linear:
    name: str
    d_in: int
    d_out: int
    input: str  # modules with the same input share its X X^T
    per_expert: bool = False  # one expert's: scored per (sample, expert) segment

    @property
    def materialised(self) -> int:
        """min(d_in, d_out): a sample of at least this many tokens takes the materialised path."""
        return min(self.d_in, self.d_out)


def num_experts(shape: dict) -> int:
    """E of an MoE shape (Qwen3-MoE's config name, or gpt-oss' and Mixtral's); 0 for a dense one."""
    return shape.get("num_experts") or shape.get("num_local_experts") or 0


def attention_width(shape: dict) -> int:
    """heads x head_dim: the width of QK^T and PV (not the hidden size in Qwen3-MoE or gpt-oss)."""
    heads = shape["num_attention_heads"]
    return heads * (shape.get("head_dim") or shape["hidden_size"] // heads)


def linears(shape: dict) -> dict[str, Linear]:
    """One decoder layer's linear modules (Llama / Qwen2 layout) from a transformers config dict. An MoE
    layer: the router, one expert's gate, up and down, and a dense MLP only for shared experts."""
    h, a = shape["hidden_size"], attention_width(shape)
    heads = shape["num_attention_heads"]
    kv = (shape.get("num_key_value_heads") or heads) * (a // heads)  # KV heads x head_dim
    out = {"q": Linear("q", h, a, "attn_in"), "k": Linear("k", h, kv, "attn_in"), "v": Linear("v", h, kv, "attn_in"),
           "o": Linear("o", a, h, "o_in")}
    E = num_experts(shape)
    if E:
        inner = shape.get("moe_intermediate_size") or shape["intermediate_size"]
        out |= {"router": Linear("router", h, E, "router_in"),
                "expert_gate": Linear("expert_gate", h, inner, "expert_in", True),
                "expert_up": Linear("expert_up", h, inner, "expert_in", True),
                "expert_down": Linear("expert_down", inner, h, "expert_down_in", True)}
    inter = shape.get("shared_expert_intermediate_size") if E else shape["intermediate_size"]
    if inter:
        out |= {"gate": Linear("gate", h, inter, "mlp_in"), "up": Linear("up", h, inter, "mlp_in"),
                "down": Linear("down", inter, h, "down_in")}
    return out


def routing(shape: dict, tokens: int) -> tuple[int, float]:
    """(experts reached, tokens each) of `tokens` tokens in one MoE layer, under the prediction's
    assumption of uniform routing (UNIFORM_ROUTING): k tokens / E each, all E reached once k tokens >= E."""
    reached = min(num_experts(shape), shape["num_experts_per_tok"] * tokens)
    each = shape["num_experts_per_tok"] * tokens / reached  # an average: need not be whole
    return reached, int(each) if each.is_integer() else each


def layer_params(shape: dict, tokens: int = 1) -> int:
    """P: the weights of the decoder layers' linear modules (embeddings and LM head apart) that `tokens`
    tokens pass through: in an MoE layer only the experts they reach (one token: its k, the active weights)."""
    experts = routing(shape, tokens)[0] if num_experts(shape) else 0
    return shape["num_hidden_layers"] * sum(m.d_in * m.d_out * (experts if m.per_expert else 1)
                                            for m in linears(shape).values())


def takes_core_path(module: Linear, T: int) -> bool:
    """The engine's rule (gradspec.engine.capture): a sample shorter than min(d_in, d_out) takes the
    T x T core path; at min(d_in, d_out) <= T the module's G = D^T X is materialised."""
    return T < module.materialised


def syrk_flops(T: int, d: int) -> int:
    """The lower triangle of Y Y^T for Y of T x d, diagonal included: T (T + 1) / 2 entries of 2 d FLOPs."""
    return T * (T + 1) * d


def gemm_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def potrf_flops(n: int) -> float:
    return n**3 / 3


def syevd_flops(n: int) -> float:
    return 4 * n**3 / 3


@dataclass(frozen=True)
class Work:
    """One stage's work per sample, by operation (FLOPs; eigensolves as (n, count); bytes)."""

    floor_flops: float = 0.0
    syrk_flops: float = 0.0
    gemm_flops: float = 0.0
    potrf_flops: float = 0.0
    eig: tuple[tuple[int, int], ...] = ()
    bytes: float = 0.0  # what the stage writes or moves, reported
    copy_bytes: float = 0.0  # device to host, timed at the copy bandwidth

    @property
    def flops(self) -> float:
        return (self.floor_flops + self.syrk_flops + self.gemm_flops + self.potrf_flops
                + sum(count * syevd_flops(n) for n, count in self.eig))

    def times(self, count: float) -> Work:
        """count of this work (layers, segments)."""
        return Work(self.floor_flops * count, self.syrk_flops * count, self.gemm_flops * count,
                    self.potrf_flops * count, tuple((n, c * count) for n, c in self.eig), self.bytes * count,
                    self.copy_bytes * count)

    def __add__(self, other: Work) -> Work:
        eig: dict[int, int] = {}
        for n, count in self.eig + other.eig:
            eig[n] = eig.get(n, 0) + count
        return Work(self.floor_flops + other.floor_flops, self.syrk_flops + other.syrk_flops,
                    self.gemm_flops + other.gemm_flops, self.potrf_flops + other.potrf_flops,
                    tuple(sorted(eig.items())), self.bytes + other.bytes, self.copy_bytes + other.copy_bytes)


def floor_work(shape: dict, T: int, response: int, batch: int = 1, dtype_bytes: int = 2,
               weight_gradients: bool = False) -> Work:
    """The floor per sample (see the module's FLOP conventions); with weight_gradients, a training step.
    Bytes: the weights read by the forward and the backward (an MoE layer's: the experts the batch
    reaches), shared by the batch."""
    P, h, L, V = layer_params(shape), shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    flops = 4 * P * T + 6 * T * T * attention_width(shape) * L + 4 * h * V * response
    if weight_gradients:
        flops += 2 * P * T + 2 * h * V * response
    return Work(floor_flops=flops, bytes=2 * (layer_params(shape, T * batch) + h * V) * dtype_bytes / batch)


def spectral_work(shape: dict, modules: str, T: int) -> dict[str, Work]:
    """Per sample: the fp64 Grams, the core-path eigen work ("core") and the materialised one ("gram"),
    each with the bytes its eigen stage reads (its copies where it runs on the host). An expert's
    parts: per segment, at its tokens (routing), times the experts a sample reaches."""
    layer, L = linears(shape), shape["num_hidden_layers"]
    scored = [layer[name] for name in MODULE_SETS[modules] if name in layer]
    reached, n = routing(shape, T) if num_experts(shape) else (0, 0)
    work = {"grams": Work(), "core": Work(), "gram": Work()}
    for input_name in dict.fromkeys(m.input for m in scored):
        group = [m for m in scored if m.input == input_name]
        expert = group[0].per_expert
        for stage, w in _input_work(group, n if expert else T).items():
            work[stage] += w.times(L * (reached if expert else 1))
    return work


def _input_work(group: list[Linear], T: float) -> dict[str, Work]:
    """The Grams and eigen work of the modules that read one input, for one sample (or segment) of T tokens."""
    grams, core, gram = Work(), Work(), Work()
    cores = [m for m in group if takes_core_path(m, T)]
    if cores:  # X X^T once for the input (in fp64: X's copy read, the T x T Gram written)
        d_in = cores[0].d_in
        grams += Work(syrk_flops=syrk_flops(T, d_in), bytes=8 * (T * d_in + T * T))
        core += Work(potrf_flops=potrf_flops(T), bytes=8 * T * T, copy_bytes=8 * T * T)
    for m in cores:  # D D^T, <D D^T, X X^T>, then L^T A L and the eigensolve at T
        grams += Work(syrk_flops=syrk_flops(T, m.d_out) + 2 * T * T, bytes=8 * (T * m.d_out + T * T))
        core += Work(gemm_flops=2 * gemm_flops(T, T, T), eig=((T, 1),), bytes=8 * T * T,
                     copy_bytes=8 * T * T + 8)
    for m in group:
        if m in cores:
            continue
        n, big = m.materialised, max(m.d_in, m.d_out)
        grams += Work(gemm_flops=gemm_flops(m.d_out, T, m.d_in) + gemm_flops(n, big, n),
                      bytes=8 * (T * (m.d_in + m.d_out) + m.d_in * m.d_out + n * n))
        gram += Work(eig=((n, 1),), bytes=8 * n * n, copy_bytes=8 * n * n)
    return {"grams": grams, "core": core, "gram": gram}


# ----------------------------------------------------------------------------- rates


@dataclass(frozen=True)
class OpRates:
    """fp64 rates of one place: the compute device, or the host's pool (threads solving one problem
    each, as the extension runs the eigen stage). syevd: (n, seconds per matrix, values only, in a
    batch); between sizes c * n^3 with c from the size bucket (the smallest measured n >= n, else the largest)."""

    where: str
    dgemm_flops: float
    dsyrk_flops: float  # useful FLOPs (T (T + 1) d) per second
    potrf_flops: float
    syevd: tuple[tuple[int, float], ...]
    paths: dict = field(default_factory=dict, compare=False)  # what was timed, for the reader

    def syevd_seconds(self, n: int) -> float:
        sizes = sorted(self.syevd)
        bucket, seconds = next(((m, s) for m, s in sizes if m >= n), sizes[-1])
        return seconds * (n / bucket) ** 3

    def scaled(self, factor: float) -> OpRates:
        """Every rate times factor (eigensolves factor times faster)."""
        return replace(self, dgemm_flops=self.dgemm_flops * factor, dsyrk_flops=self.dsyrk_flops * factor,
                       potrf_flops=self.potrf_flops * factor, syevd=tuple((n, s / factor) for n, s in self.syevd))


@dataclass(frozen=True)
class Rates:
    """What measure_rates measured: the floor's GEMM rate per width in the model dtype, the compute
    device's fp64 rates, the host pool's (the same object on a CPU) and the copy bandwidth."""

    device: str  # "cpu", or the GPU's name
    floor_dtype: str
    floor: tuple[tuple[int, float], ...]  # (width h, FLOP/s of (tokens x h) @ (h x 4h))
    compute: OpRates
    host: OpRates
    copy_bytes_s: float  # device to host (pinned); on a CPU a memory copy (not used: nothing moves)
    host_threads: int
    seconds: float = 0.0  # how long the measurement took

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def floor_flops(self, width: int) -> float:
        """The floor rate at the measured width nearest to width (in log scale)."""
        return min(self.floor, key=lambda wr: abs(math.log(wr[0] / width)))[1]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Rates:
        ops = lambda o: OpRates(**{**o, "syevd": tuple(map(tuple, o["syevd"]))})  # noqa: E731
        return cls(**{**d, "floor": tuple(map(tuple, d["floor"])), "compute": ops(d["compute"]),
                      "host": ops(d["host"])})


# ----------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Row:
    stage: str
    flops: float
    bytes: float
    seconds: float  # per sample

    @property
    def samples_s(self) -> float:
        return 1 / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class Prediction:
    rows: tuple[Row, ...]
    serial_s: float
    overlapped_s: float
    placement: dict  # {"core": "host" | "device", "gram": ...}
    train_step_s: float

    @property
    def serial_samples_s(self) -> float:
        return 1 / self.serial_s

    @property
    def overlapped_samples_s(self) -> float:
        return 1 / self.overlapped_s

    def stage_seconds(self) -> dict[str, float]:
        return {r.stage: r.seconds for r in self.rows}

    def as_dict(self) -> dict:
        return {"label": PREDICTION, "placement": self.placement,
                "rows": [asdict(r) | {"samples_s": r.samples_s} for r in self.rows],
                "serial_s": self.serial_s, "serial_samples_s": self.serial_samples_s,
                "overlapped_s": self.overlapped_s, "overlapped_samples_s": self.overlapped_samples_s,
                "train_step_s": self.train_step_s, "train_step_samples_s": 1 / self.train_step_s}


def work_seconds(work: Work, ops: OpRates) -> float:
    """fp64 compute at ops' rates (the floor's FLOPs are not timed here)."""
    return (work.syrk_flops / ops.dsyrk_flops + work.gemm_flops / ops.dgemm_flops
            + work.potrf_flops / ops.potrf_flops + sum(count * ops.syevd_seconds(n) for n, count in work.eig))


def predict(shape: dict, modules: str, T: int, response: int, rates: Rates, batch: int = 1,
            placement: dict | str = "host", dtype_bytes: int = 2) -> Prediction:
    """Per-sample seconds of each stage and the totals, with each eigen stage ("core", "gram") on
    the host or the compute device (a str places both). On a CPU both places are the host."""
    if isinstance(placement, str):
        placement = {"core": placement, "gram": placement}
    if not rates.on_gpu:
        placement = {"core": "host", "gram": "host"}
    width = shape["hidden_size"]
    floor = floor_work(shape, T, response, batch, dtype_bytes)
    train = floor_work(shape, T, response, batch, dtype_bytes, weight_gradients=True)
    spectral = spectral_work(shape, modules, T)
    rows = [Row("floor", floor.flops, floor.bytes, floor.flops / rates.floor_flops(width)),
            Row("fp64 grams", spectral["grams"].flops, spectral["grams"].bytes,
                work_seconds(spectral["grams"], rates.compute))]
    on = {where: Work() for where in ("host", "device")}
    for stage in ("core", "gram"):
        on[placement[stage]] += spectral[stage]
    host, device = on["host"], on["device"]
    if rates.on_gpu:
        rows.append(Row("cores and eigen (device)", device.flops, device.bytes, work_seconds(device, rates.compute)))
    rows.append(Row("cores and eigen (host)", host.flops, host.bytes, work_seconds(host, rates.host)))
    copy_bytes = host.copy_bytes if rates.on_gpu else 0.0
    rows.append(Row("copies to the host", 0.0, copy_bytes, copy_bytes / rates.copy_bytes_s))
    seconds = {r.stage: r.seconds for r in rows}
    serial = sum(seconds.values())
    if rates.on_gpu:
        host_side = seconds["cores and eigen (host)"]
        overlapped = max(serial - host_side, host_side)
    else:
        overlapped = serial
    return Prediction(tuple(rows), serial, overlapped, placement, train.flops / rates.floor_flops(width))


def predict_best(shape: dict, modules: str, T: int, response: int, rates: Rates, batch: int = 1,
                 dtype_bytes: int = 2) -> Prediction:
    """The placement the engine's measured dispatch would choose, as this model sees it: per eigen
    stage, the faster of host and device (the serial total decides)."""
    places = ("host", "device") if rates.on_gpu else ("host",)
    options = [predict(shape, modules, T, response, rates, batch, {"core": c, "gram": g}, dtype_bytes)
               for c in places for g in places]
    return min(options, key=lambda p: p.serial_s)


# ----------------------------------------------------------------------------- measuring the rates


def _seconds(fn: Callable[[], object], device: str, reps: int) -> float:
    """Seconds of fn, the fastest of reps after one warm-up (the machine's rate, not another process's
    load of the moment): CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _pool_seconds(task: Callable[[int], object], jobs: int, threads: int, reps: int) -> float:
    """Wall seconds per job of `jobs` calls of task(i) over `threads` threads, each with one BLAS
    and torch thread (as the extension runs its eigen stage): the fastest of reps, after a warm-up."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    old = torch.get_num_threads()
    with threadpool_limits(limits=1), ThreadPoolExecutor(threads) as pool:
        torch.set_num_threads(1)
        try:
            list(pool.map(task, range(min(jobs, threads))))
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                list(pool.map(task, range(jobs)))
                times.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(old)
    return min(times) / jobs


def _spd(count: int, n: int, device: str, seed: int = 0) -> torch.Tensor:
    """count positive definite fp64 n x n matrices (Grams of n x 2n Gaussians)."""
    Y = torch.randn(count, n, 2 * n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (Y @ Y.mT).to(device)


def _syevd_count(n: int, threads: int) -> int:
    """Matrices per timed eigensolve call: enough that a call at n = 32 (MoE segments) lasts milliseconds.
    With 16 it lasted 0.3 ms, and quick runs on a shared 2-core VM put n = 32 30x apart."""
    return max(threads, 2 * threads * (256 // n) ** 2)


def _host_rates(threads: int, quick: bool, reps: int) -> OpRates:
    """The host pool's fp64 rates: GEMM and Cholesky by torch on one thread each; SYRK and eigensolves
    by gradspec's extension (its own threads, dsyrk and dsyevd) where it is built, else by torch."""
    from gradspec.linalg import extension

    jobs = 2 * threads
    n = 512
    A = torch.randn(jobs, n, n, dtype=torch.float64)
    S = _spd(jobs, n, "cpu")
    paths = {"dgemm": f"torch matmul {n}^3, {threads} threads x 1", "potrf": f"torch cholesky n={n}"}
    dgemm = gemm_flops(n, n, n) / _pool_seconds(lambda i: A[i] @ A[i - 1], jobs, threads, reps)
    potrf = potrf_flops(n) / _pool_seconds(lambda i: torch.linalg.cholesky(S[i]), jobs, threads, reps)
    T, d = 512, 512 if quick else 2048
    Y = torch.randn(jobs, T, d, dtype=torch.float64)
    sizes = QUICK_SYEVD_SIZES if quick else SYEVD_SIZES
    syevd = []
    if extension.BUILT:
        lengths = torch.full((jobs,), T, dtype=torch.int64).numpy()

        def syrk():
            with extension.ONE_BLAS_THREAD():
                extension.C.segment_gram(Y.numpy(), lengths, None, threads)

        dsyrk = jobs * syrk_flops(T, d) / _seconds(syrk, "cpu", reps)
        paths |= {"dsyrk": f"gradspec._C segment_gram (dsyrk) T={T} d={d}", "syevd": "gradspec._C gram_spectra"
                  f" (dsyevd, values only; {extension.LAPACK})"}
        for m in sizes:
            grams = _spd(_syevd_count(m, threads), m, "cpu", seed=m).numpy()

            def solve(grams=grams):
                with extension.ONE_BLAS_THREAD():
                    extension.C.gram_spectra(grams, threads, 2.0**-52, 0)

            syevd.append((m, _seconds(solve, "cpu", reps) / len(grams)))
    else:
        dsyrk = syrk_flops(T, d) / _pool_seconds(lambda i: Y[i] @ Y[i].mT, jobs, threads, reps)
        paths |= {"dsyrk": f"torch matmul (full product) T={T} d={d}", "syevd": "torch eigvalsh"}
        for m in sizes:
            grams = _spd(_syevd_count(m, threads), m, "cpu", seed=m)
            syevd.append((m, _pool_seconds(lambda i, g=grams: torch.linalg.eigvalsh(g[i]), len(grams), threads, reps)))
    return OpRates("host", dgemm, dsyrk, potrf, tuple(syevd), paths)


def _device_eigensolvers() -> dict[str, Callable]:
    """torch's eigvalsh and, where installed, CuPy's and cuSOLVER's XsyevBatched (gradspec.linalg.solvers)."""
    from gradspec.linalg import solvers

    found = {"torch": torch.linalg.eigvalsh}
    for name, getter in (("cupy", "cupy_eigen"), ("nvmath", "nvmath_eigen")):
        try:
            solver = getattr(solvers, getter, lambda: None)()
        except Exception:  # noqa: BLE001 - an optional solver that fails is left out
            solver = None
        if solver is not None:
            found[name] = solver.eigvalsh
    return found


def _device_rates(device: str, quick: bool, reps: int) -> OpRates:
    """The GPU's fp64 rates by torch (batched, as the engine calls them), and its best eigensolver per n."""
    n, count = 512, 16
    A = torch.randn(count, n, n, dtype=torch.float64, device=device)
    S = _spd(count, n, device)
    dgemm = count * gemm_flops(n, n, n) / _seconds(lambda: A @ A, device, reps)
    potrf = count * potrf_flops(n) / _seconds(lambda: torch.linalg.cholesky_ex(S), device, reps)
    T, d = 512, 2048 if quick else 4096
    Y = torch.randn(8, T, d, dtype=torch.float64, device=device)
    dsyrk = 8 * syrk_flops(T, d) / _seconds(lambda: Y @ Y.mT, device, reps)
    syevd, chosen = [], {}
    for m in QUICK_SYEVD_SIZES if quick else SYEVD_SIZES:
        grams = _spd(max(4, 2048 // m), m, device, seed=m)
        best = {}
        for name, eigvalsh in _device_eigensolvers().items():
            try:
                best[name] = _seconds(lambda f=eigvalsh, g=grams: f(g), device, reps) / len(grams)
            except Exception:  # noqa: BLE001 - a solver that fails at this size is left out
                continue
        chosen[m] = min(best, key=best.get)
        syevd.append((m, best[chosen[m]]))
    paths = {"dgemm": f"torch bmm {count} x {n}^3", "potrf": f"torch cholesky_ex {count} x n={n}",
             "dsyrk": f"torch Y @ Y^T (full product) 8 x T={T} d={d}", "syevd": chosen}
    return OpRates("device", dgemm, dsyrk, potrf, tuple(syevd), paths)


def _floor_rates(device: str, quick: bool, reps: int, dtype: torch.dtype | None = None
                 ) -> tuple[str, tuple[tuple[int, float], ...]]:
    """The floor's rate: a GEMM (tokens x h) @ (h x 4h) per width h, in the model's dtype (default:
    bf16 on a GPU, fp32 on the CPU)."""
    cuda = device.startswith("cuda")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    if cuda:
        tokens, widths = (4096, (576, 1536, 4096)) if quick else (8192, (576, 1024, 1536, 2048, 4096))
    else:
        tokens, widths = (1024, (576, 1024)) if quick else (2048, (576, 1024, 1536, 2048))
    rates = []
    for h in widths:
        X = torch.randn(tokens, h, dtype=dtype, device=device)
        W = torch.randn(h, 4 * h, dtype=dtype, device=device)
        rates.append((h, gemm_flops(tokens, h, 4 * h) / _seconds(lambda X=X, W=W: X @ W, device, reps)))
    return str(dtype).removeprefix("torch."), tuple(rates)


def _copy_rate(device: str, quick: bool, reps: int) -> float:
    """Bytes/s device to pinned host memory on a GPU; a memory-to-memory copy on the CPU."""
    size = (64 if quick else 256) * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    if device.startswith("cuda"):
        dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return size / _seconds(lambda: dst.copy_(src, non_blocking=True), device, reps)
    dst = torch.empty_like(src)
    return size / _seconds(lambda: dst.copy_(src), device, reps)


def measure_rates(device: str = "cpu", host_threads: int | None = None, quick: bool = False,
                  dtype: torch.dtype | None = None) -> Rates:
    """The per-operation rates of this machine: on CUDA timed with events, on the CPU by the wall
    clock. quick: small sizes and few repetitions (about 2 s on a 2-core CPU, a few seconds on a GPU).
    host_threads: the host pool's threads (default: the extension's); dtype: the floor's (the model's)."""
    from gradspec.linalg import extension

    start = time.perf_counter()
    threads = host_threads or extension.default_threads()
    reps = 3 if quick else 5
    cuda = device.startswith("cuda")
    floor_dtype, floor = _floor_rates(device, quick, reps, dtype)
    host = _host_rates(threads, quick, reps)
    compute = _device_rates(device, quick, reps) if cuda else host
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return Rates(name, floor_dtype, floor, compute, host, _copy_rate(device, quick, reps), threads,
                 time.perf_counter() - start)


# ----------------------------------------------------------------------------- report


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def table(prediction: Prediction) -> list[str]:
    """The prediction as a markdown table: stage, FLOPs, bytes, seconds and samples/s per sample."""
    lines = ["| stage (predicted, per sample) | FLOPs | bytes | time | rate |", "|---|---:|---:|---:|---:|"]
    for r in prediction.rows:
        rate = "" if r.seconds == 0 else f"{r.samples_s:.3g}/s"
        lines.append(f"| {r.stage} | {_si(r.flops)} | {_si(r.bytes, 'B')} | {_ms(r.seconds)} | {rate} |")
    lines.append(f"| **total, serial** (score) | | | {_ms(prediction.serial_s)} "
                 f"| **{prediction.serial_samples_s:.3g}/s** |")
    lines.append(f"| **total, overlapped** (submit) | | | {_ms(prediction.overlapped_s)} "
                 f"| **{prediction.overlapped_samples_s:.3g}/s** |")
    lines.append(f"| training step (for comparison) | | | {_ms(prediction.train_step_s)} "
                 f"| {1 / prediction.train_step_s:.3g}/s |")
    return lines


def rates_lines(rates: Rates) -> list[str]:
    lines = [f"Rates measured on {rates.device} in {rates.seconds:.1f} s (host pool: {rates.host_threads} threads):",
             "", "- floor GEMM (" + rates.floor_dtype + "): "
             + ", ".join(f"h={h}: {_si(r, 'FLOP/s')}" for h, r in rates.floor)]
    for ops in dict.fromkeys((rates.compute, rates.host)):
        lines.append(f"- {ops.where} fp64: DGEMM {_si(ops.dgemm_flops, 'FLOP/s')}, "
                     f"SYRK {_si(ops.dsyrk_flops, 'FLOP/s')}, potrf {_si(ops.potrf_flops, 'FLOP/s')}; "
                     "syevd per matrix: "
                     + ", ".join(f"n={n}: {_ms(s)}" for n, s in ops.syevd) + f" ({ops.paths})")
    where = "device to pinned host" if rates.on_gpu else "host memory, not used: nothing moves"
    lines.append(f"- copy: {_si(rates.copy_bytes_s, 'B/s')} ({where})")
    return lines


def moe_line(name: str, shape: dict, T: int) -> str:
    """What an MoE prediction assumes of its routing, in words."""
    reached, n = routing(shape, T)
    return (f"{name}: MoE, {UNIFORM_ROUTING}: {reached} of {num_experts(shape)} experts reached per sample, "
            f"{n} tokens each (top-{shape['num_experts_per_tok']}); {layer_params(shape) / 1e9:.3g} G active "
            "decoder-layer weights a token")


def report(rates: Rates, shapes: dict, T: int = 512, batch: int = 16) -> tuple[dict, str]:
    """Predictions for every model shape and module set at T tokens (half of them the response), after
    a summary of every model's samples/s (dense and MoE side by side) at the best eigen placement."""
    response = T - T // 2
    result: dict = {"label": PREDICTION, "rates": rates.as_dict(), "T": T, "response": response, "batch": batch,
                    "predictions": []}
    md = ["# Cost model: predictions", "", f"Every figure below is a {PREDICTION}. T = {T}, {response} response "
          f"tokens, batch {batch}; fp64 Grams and cores. Overlapped: the host's eigen stage beside the device's "
          "next batch (on the CPU: equal to serial).", "", *rates_lines(rates), ""]
    summary = ["## Summary: samples/s per model, eigen stage placed best (predicted)", "",
               "| model | modules | floor | score (serial) | submit (overlapped) | training step |",
               "|---|---|---:|---:|---:|---:|"]
    notes, sections = [], []
    dtype_bytes = getattr(torch, rates.floor_dtype).itemsize
    for name, (_, shape) in shapes.items():
        moe = {}
        if num_experts(shape):
            reached, n = routing(shape, T)
            moe = {"moe": {"experts": num_experts(shape), "top_k": shape["num_experts_per_tok"], "reached": reached,
                           "tokens_each": n, "routing": UNIFORM_ROUTING}}
            notes.append("- " + moe_line(name, shape, T))
        for modules in MODULE_SETS:
            placements = ["best"] + (["host", "device"] if rates.on_gpu else [])
            for place in placements:
                p = (predict_best(shape, modules, T, response, rates, batch, dtype_bytes) if place == "best"
                     else predict(shape, modules, T, response, rates, batch, place, dtype_bytes))
                result["predictions"].append({"model": name, "modules": modules, "eigen": place, **p.as_dict(), **moe})
                sections += [f"## {name}, {modules}, eigen stage: {place} {p.placement}", "", *table(p), ""]
                if place == "best":
                    summary.append(f"| {name} | {modules} | {1 / p.stage_seconds()['floor']:.3g}/s "
                                   f"| **{p.serial_samples_s:.3g}/s** | {p.overlapped_samples_s:.3g}/s "
                                   f"| {1 / p.train_step_s:.3g}/s |")
    if notes:
        notes = ["", *notes, "- the floor's rate is the dense GEMM's at the hidden width: an MoE layer's "
                 "per-expert GEMMs (fewer rows) run slower, which this model does not count"]
    return result, "\n".join(md + summary + notes + [""] + sections) + "\n"


def load_rates(path: str) -> Rates:
    """Rates written before: cost_model.json (--out) or the GPU suite's results.json (its cost_model)."""
    d = json.loads(Path(path).read_text())
    return Rates.from_dict(d.get("cost_model", d)["rates"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    p.add_argument("--host-threads", type=int, default=None, help="default: the extension's threads")
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rates", default=None, help="rates measured before (cost_model.json, or a GPU suite's "
                   "results.json: an H200's) instead of measuring here")
    p.add_argument("--out", default=None, help="writes cost_model.json and cost_model.md there")
    args = p.parse_args(argv)

    rates = load_rates(args.rates) if args.rates else measure_rates(args.device, args.host_threads, args.quick)
    result, md = report(rates, SHAPES | MOE_SHAPES, args.T, args.batch)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cost_model.json").write_text(json.dumps(result, indent=1))
        (out / "cost_model.md").write_text(md)


if __name__ == "__main__":
    main()
