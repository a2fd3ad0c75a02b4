"""benchmarks/gpu/cost_model.py: its FLOP counts by hand, the engine's core/materialised rule, how its
predictions scale with the rates, and its rates measured on this CPU (no timing is asserted)."""

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package at the root of the checkout

from benchmarks.common import SHAPES  # noqa: E402
from benchmarks.gpu import cost_model as cm  # noqa: E402

# One layer: q 8 -> 8, k and v 8 -> 4 (head_dim 4, one KV head), o 8 -> 8, gate and up 8 -> 12, down 12 -> 8.
TINY = dict(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=10)

# One MoE layer: q 8 -> 12 (2 heads of 6), k and v 8 -> 6, o 12 -> 8, router 8 -> 4; 4 experts, top-2, each
# gate and up 8 -> 6 and down 6 -> 8. At T = 6 each sample reaches all 4 experts, 2 * 6 / 4 = 3 tokens each.
TINY_MOE = dict(hidden_size=8, moe_intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=6, num_experts=4, num_experts_per_tok=2, vocab_size=10)


def rates(device: str = "cpu", **host) -> cm.Rates:
    """Round-number rates: 1 GFLOP/s everywhere, syevd 1 ms at n = 8 (so c = 1e-3 / 8^3), 1 GB/s copies."""
    ops = cm.OpRates("host", 1e9, 1e9, 1e9, ((8, 1e-3),))
    ops = replace(ops, **host)
    compute = replace(ops, where="device") if device != "cpu" else ops
    return cm.Rates(device, "float32", ((8, 1e9),), compute, ops, 1e9, 2)


def test_conventions():
    assert cm.syrk_flops(6, 8) == 6 * 7 * 8  # T (T + 1) / 2 entries, 2 d FLOPs each
    assert cm.gemm_flops(2, 3, 4) == 48
    assert cm.potrf_flops(6) == 72
    assert cm.syevd_flops(3) == 36
    assert cm.layer_params(TINY) == 64 + 32 + 32 + 64 + 3 * 96


def test_floor_flops_by_hand():
    # P = 480; T = 6, R = 3: 4 P T + 6 T^2 h L + 4 h V R
    assert cm.floor_work(TINY, 6, 3).flops == 4 * 480 * 6 + 6 * 36 * 8 + 4 * 8 * 10 * 3 == 14208
    # a training step adds the weight gradients: 2 P T + 2 h V R
    assert cm.floor_work(TINY, 6, 3, weight_gradients=True).flops == 14208 + 2 * 480 * 6 + 2 * 8 * 10 * 3
    two = {**TINY, "num_hidden_layers": 2}
    assert cm.floor_work(two, 6, 3).flops == 8 * 480 * 6 + 12 * 36 * 8 + 4 * 8 * 10 * 3


def test_spectral_flops_by_hand_attn():
    """T = 6: q and o take the core path (min side 8 > 6), k and v are materialised (min side 4 <= 6)."""
    work = cm.spectral_work(TINY, "attn", 6)
    # X X^T for q/k/v's input and for o's; D D^T and <D D^T, X X^T> for q and o
    assert work["grams"].syrk_flops == 2 * 336 + 2 * (336 + 2 * 36)
    # k and v: G = D^T X (4 x 6 @ 6 x 8), then G G^T (4 x 8 @ 8 x 4)
    assert work["grams"].gemm_flops == 2 * (2 * 4 * 6 * 8 + 2 * 4 * 8 * 4)
    assert work["core"].potrf_flops == 2 * 6**3 / 3  # one Cholesky per input
    assert work["core"].gemm_flops == 2 * 4 * 6**3  # L^T A L by two GEMMs, q and o
    assert work["core"].eig == ((6, 2),)
    assert work["gram"].eig == ((4, 2),)
    assert work["core"].copy_bytes == 2 * 8 * 36 + 2 * (8 * 36 + 8)
    assert work["gram"].copy_bytes == 2 * 8 * 16
    assert work["core"].flops == 2 * 72 + 2 * 864 + 2 * cm.syevd_flops(6)
    doubled = cm.spectral_work({**TINY, "num_hidden_layers": 2}, "attn", 6)
    assert doubled["grams"].flops == 2 * work["grams"].flops and doubled["core"].eig == ((6, 4),)


def test_spectral_flops_by_hand_all():
    """T = 6, all modules: gate and up share an input (one X X^T), down reads 12 features."""
    work = cm.spectral_work(TINY, "all", 6)
    attn = cm.spectral_work(TINY, "attn", 6)
    mlp_syrk = 336 + 2 * (6 * 7 * 12 + 72) + 6 * 7 * 12 + (336 + 72)
    assert work["grams"].syrk_flops == attn["grams"].syrk_flops + mlp_syrk
    assert work["core"].eig == ((6, 5),) and work["core"].potrf_flops == 4 * 72


@pytest.mark.parametrize("module", ["k", "q", "down"])
def test_core_or_materialised_switches_at_the_smaller_side(module):
    m = cm.linears(TINY)[module]
    n = min(m.d_in, m.d_out)
    assert cm.takes_core_path(m, n - 1) and not cm.takes_core_path(m, n)
    modules = "attn" if module in ("q", "k") else "all"
    below, at = cm.spectral_work(TINY, modules, n - 1), cm.spectral_work(TINY, modules, n)
    assert (n, 1) not in below["gram"].eig
    assert dict(at["gram"].eig).get(n, 0) >= 1


def test_materialised_rule_on_the_real_shapes():
    """At T = 512 SmolLM2's k/v (192) and Qwen2.5's (256) are materialised, Llama-3-8B's (1024) are not."""
    eig = {name: cm.spectral_work(shape, "attn", 512)["gram"].eig for name, (_, shape) in SHAPES.items()}
    assert eig == {"SmolLM2-135M": ((192, 60),), "Qwen2.5-1.5B": ((256, 56),), "Llama-3-8B": ()}


def test_syevd_bucket_interpolation():
    ops = cm.OpRates("host", 1.0, 1.0, 1.0, ((64, 8e-3), (128, 32e-3)))
    assert ops.syevd_seconds(64) == 8e-3
    assert ops.syevd_seconds(32) == pytest.approx(1e-3)  # bucket 64: c = 8e-3 / 64^3
    assert ops.syevd_seconds(100) == pytest.approx(32e-3 * (100 / 128) ** 3)  # bucket 128
    assert ops.syevd_seconds(256) == pytest.approx(32e-3 * 8)  # above the largest: its c


def test_prediction_by_hand_on_the_cpu():
    r = rates()
    p = cm.predict(TINY, "attn", 6, 3, r)
    seconds = p.stage_seconds()
    work = cm.spectral_work(TINY, "attn", 6)
    assert seconds["floor"] == pytest.approx(14208 / 1e9)
    assert seconds["fp64 grams"] == pytest.approx((work["grams"].syrk_flops + work["grams"].gemm_flops) / 1e9)
    eig = 2 * 1e-3 * (6 / 8) ** 3 + 2 * 1e-3 * (4 / 8) ** 3
    assert seconds["cores and eigen (host)"] == pytest.approx((144 + 1728) / 1e9 + eig)
    assert seconds["copies to the host"] == 0  # on the CPU nothing moves
    assert p.serial_s == pytest.approx(sum(seconds.values())) and p.overlapped_s == p.serial_s
    assert p.serial_samples_s == pytest.approx(1 / p.serial_s)


def test_predicted_seconds_scale_with_the_rates():
    base = cm.predict(TINY, "all", 6, 3, rates("gpu"), placement="host").stage_seconds()
    r = rates("gpu")
    faster_floor = replace(r, floor=((8, 2e9),))
    assert cm.predict(TINY, "all", 6, 3, faster_floor, placement="host").stage_seconds()["floor"] == \
        pytest.approx(base["floor"] / 2)
    faster_host = replace(r, host=r.host.scaled(2))
    got = cm.predict(TINY, "all", 6, 3, faster_host, placement="host").stage_seconds()
    assert got["cores and eigen (host)"] == pytest.approx(base["cores and eigen (host)"] / 2)
    assert got["fp64 grams"] == base["fp64 grams"]  # formed on the device: the host's rates do not matter
    faster_device = replace(r, compute=r.compute.scaled(2))
    got = cm.predict(TINY, "all", 6, 3, faster_device, placement="host").stage_seconds()
    assert got["fp64 grams"] == pytest.approx(base["fp64 grams"] / 2)
    faster_copies = replace(r, copy_bytes_s=2e9)
    got = cm.predict(TINY, "all", 6, 3, faster_copies, placement="host").stage_seconds()
    assert base["copies to the host"] > 0
    assert got["copies to the host"] == pytest.approx(base["copies to the host"] / 2)
    # the eigen stage on the device: no copies, and the host's rates do not matter
    device = cm.predict(TINY, "all", 6, 3, faster_host, placement="device")
    assert device.stage_seconds()["copies to the host"] == 0
    assert device.stage_seconds()["cores and eigen (device)"] == pytest.approx(base["cores and eigen (host)"])


def test_overlapped_total_on_a_gpu():
    p = cm.predict(TINY, "all", 6, 3, rates("gpu"), placement="host")
    s = p.stage_seconds()
    host = s["cores and eigen (host)"]
    assert p.overlapped_s == pytest.approx(max(p.serial_s - host, host)) and p.overlapped_s < p.serial_s
    # the best placement is never slower than either
    best = cm.predict_best(TINY, "all", 6, 3, rates("gpu"))
    assert best.serial_s <= min(cm.predict(TINY, "all", 6, 3, rates("gpu"), placement=w).serial_s
                                for w in ("host", "device"))


def test_measure_rates_on_this_cpu_quick():
    r = cm.measure_rates("cpu", 2, quick=True)
    values = [rate for _, rate in r.floor] + [r.host.dgemm_flops, r.host.dsyrk_flops, r.host.potrf_flops,
                                             r.copy_bytes_s] + [s for _, s in r.host.syevd]
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert r.compute is r.host and not r.on_gpu and r.host_threads == 2
    assert [n for n, _ in r.host.syevd] == list(cm.QUICK_SYEVD_SIZES)
    again = cm.Rates.from_dict(json.loads(json.dumps(r.as_dict())))
    assert again.floor == r.floor and again.host.syevd == r.host.syevd
    _, md = cm.report(r, {"SmolLM2-135M": SHAPES["SmolLM2-135M"]})
    assert "prediction" in md and "| **total, serial** (score) |" in md
    p = cm.predict_best(SHAPES["SmolLM2-135M"][1], "attn", 512, 256, r, batch=16)
    assert math.isfinite(p.serial_samples_s) and p.serial_samples_s > 0


def test_moe_shape_by_hand():
    layer = cm.linears(TINY_MOE)
    assert {name: (m.d_in, m.d_out, m.input, m.per_expert) for name, m in layer.items()} == {
        "q": (8, 12, "attn_in", False), "k": (8, 6, "attn_in", False), "v": (8, 6, "attn_in", False),
        "o": (12, 8, "o_in", False), "router": (8, 4, "router_in", False),
        "expert_gate": (8, 6, "expert_in", True), "expert_up": (8, 6, "expert_in", True),
        "expert_down": (6, 8, "expert_down_in", True)}
    assert cm.attention_width(TINY_MOE) == 12 and cm.attention_width(TINY) == 8
    # uniform routing: k T / E tokens per expert, all E reached once k T >= E
    assert cm.routing(TINY_MOE, 6) == (4, 3)
    assert cm.routing(TINY_MOE, 5) == (4, 2.5)  # an average, not a whole count
    assert cm.routing(TINY_MOE, 1) == (2, 1)  # one token: its k experts
    # active weights: attention 288, router 32, two experts of 3 x 48
    assert cm.layer_params(TINY_MOE) == 288 + 32 + 2 * 144 == 608
    assert cm.layer_params(TINY_MOE, tokens=12) == 288 + 32 + 4 * 144  # the experts a batch reaches: all 4
    # gpt-oss' and Mixtral's name for E; shared experts are a dense MLP beside the experts
    assert cm.linears({**TINY_MOE, "num_experts": None, "num_local_experts": 4})["router"].d_out == 4
    shared = {**TINY_MOE, "shared_expert_intermediate_size": 4}
    assert [cm.linears(shared)[n].d_out for n in ("gate", "up", "down")] == [4, 4, 8]
    assert cm.layer_params(shared) == 608 + 3 * 32
    assert "gate" not in layer and "router" not in cm.linears(TINY)


def test_moe_floor_flops_by_hand():
    # P = 608 (active), attention width 12; T = 6, R = 3: 4 P T + 6 T^2 a L + 4 h V R
    assert cm.floor_work(TINY_MOE, 6, 3).flops == 4 * 608 * 6 + 6 * 36 * 12 + 4 * 8 * 10 * 3 == 18144
    assert cm.floor_work(TINY_MOE, 6, 3, weight_gradients=True).flops == 18144 + 2 * 608 * 6 + 2 * 8 * 10 * 3
    # bytes: the weights the batch reaches (all 4 experts: 896) and the LM head's 80, forward and backward, bf16
    assert cm.floor_work(TINY_MOE, 6, 3).bytes == 2 * (896 + 80) * 2


def test_moe_spectral_flops_by_hand():
    """T = 6, all parts: q and o core, k and v materialised at 6, the router at 4; 4 expert segments of
    3 tokens, every expert part on the core path (3 < 6)."""
    work = cm.spectral_work(TINY_MOE, "all", 6)
    dense_syrk = 6 * 7 * 8 + (6 * 7 * 12 + 72) + 6 * 7 * 12 + (6 * 7 * 8 + 72)  # q/k/v's X X^T, q's D D^T, o's
    # per segment: gate/up's X X^T (3 x 8), gate's and up's D D^T (3 x 6) and <., .>, down's X X^T (3 x 6),
    # down's D D^T (3 x 8) and <., .>
    segment_syrk = 3 * 4 * 8 + 2 * (3 * 4 * 6 + 2 * 9) + 3 * 4 * 6 + (3 * 4 * 8 + 2 * 9)
    assert segment_syrk == 462
    assert work["grams"].syrk_flops == dense_syrk + 4 * 462 == 3672
    # k and v: G (6 x 6 @ 6 x 8) and G G^T (6 x 8 @ 8 x 6); the router: G (4 x 6 @ 6 x 8) and G G^T (4 x 8 @ 8 x 4)
    assert work["grams"].gemm_flops == 2 * (576 + 576) + (384 + 256) == 2944
    assert work["core"].potrf_flops == 2 * 72 + 4 * 2 * 9  # q/k/v's and o's input; per segment, two inputs
    assert work["core"].gemm_flops == 2 * 864 + 4 * 3 * 2 * 54  # L^T A L: q, o; 3 parts a segment
    assert work["core"].eig == ((3, 12), (6, 2))
    assert work["gram"].eig == ((4, 1), (6, 2))
    # copies per segment: two B's (8 x 9 bytes each) and three A's (8 x 9) with their inner products
    experts = work["core"].copy_bytes - cm.spectral_work(TINY_MOE, "attn", 6)["core"].copy_bytes
    assert experts == 4 * (2 * 72 + 3 * (72 + 8))
    # T = 12: 6-token segments reach min(d_in, d_out) = 6: every expert part materialised, as every dense one
    at = cm.spectral_work(TINY_MOE, "all", 12)
    assert at["core"].eig == () and at["gram"].eig == ((4, 1), (6, 2 + 3 * 4), (8, 2))
    # two layers: twice the work
    assert cm.spectral_work({**TINY_MOE, "num_hidden_layers": 2}, "all", 6)["core"].eig == ((3, 24), (6, 4))


def test_moe_rule_on_the_real_shapes():
    """At T = 512: Qwen3-30B-A3B's segments are 32 tokens (128 experts, top-8), gpt-oss-20b's 64 (32, top-4),
    both on the core path (32 < 768, 64 < 2880); k/v (512 wide) and the routers are materialised."""
    got = {name: cm.spectral_work(shape, "all", 512) for name, (_, shape) in cm.MOE_SHAPES.items()}
    assert got["Qwen3-30B-A3B"]["core"].eig == ((32, 3 * 128 * 48), (512, 2 * 48))
    assert got["Qwen3-30B-A3B"]["gram"].eig == ((128, 48), (512, 2 * 48))
    assert got["gpt-oss-20b"]["core"].eig == ((64, 3 * 32 * 24), (512, 2 * 24))
    assert got["gpt-oss-20b"]["gram"].eig == ((32, 24), (512, 2 * 24))
    qwen3, oss = cm.MOE_SHAPES["Qwen3-30B-A3B"][1], cm.MOE_SHAPES["gpt-oss-20b"][1]
    assert cm.layer_params(qwen3) == 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2048 * 128 + 8 * 3 * 2048 * 768)
    assert cm.layer_params(oss) == 24 * (2 * 2880 * 4096 + 2 * 2880 * 512 + 2880 * 32 + 4 * 3 * 2880 * 2880)


def test_report_puts_moe_beside_dense(tmp_path):
    result, md = cm.report(rates(), {"tiny": ("llama", TINY), "tiny-moe": ("qwen3_moe", TINY_MOE)}, T=6, batch=2)
    assert "| tiny | all |" in md and "| tiny-moe | all |" in md and cm.UNIFORM_ROUTING in md
    moe = [p for p in result["predictions"] if p["model"] == "tiny-moe"]
    assert moe and all(p["moe"]["reached"] == 4 and p["moe"]["tokens_each"] == 3 for p in moe)
    assert not any("moe" in p for p in result["predictions"] if p["model"] == "tiny")
    # rates written before, from cost_model.json or a GPU suite's results.json
    r = rates("NVIDIA H200")
    for i, d in enumerate(({"rates": r.as_dict()}, {"cost_model": {"rates": r.as_dict()}})):
        (tmp_path / f"{i}.json").write_text(json.dumps(d))
        assert cm.load_rates(str(tmp_path / f"{i}.json")) == r
