"""Peak memory of a training step with the spectral monitor under activation checkpointing.

SmolLM2-135M-Instruct (fp32), train mode, one forward and backward of 4 random sequences of 256
tokens (all response), SGD at learning rate 0. Rows, each in a fresh process (``python
bench_checkpointing.py ROW``): without and with non-reentrant checkpointing, each without and with
the monitor on every module (``all``), and checkpointed with the monitor holding each module's
first-run input until its gradient arrives (what it did before ``gradspec.layers.checkpointing``;
here by making every forward look plain). The figure is the step's peak of the bytes malloc has
handed out (glibc's mallinfo2, arenas and mmapped blocks, sampled every millisecond by a thread)
over those just before it, after one warm-up step; the weight gradients exist before the step
(zeroed, not freed), so the peak is the activations', the monitor's and the backward's own. Run
with ``pytest benchmarks/memory/bench_checkpointing.py -s``.
"""

import ctypes
import subprocess
import sys
import threading
import time

ROWS = {
    "plain": (False, False, False),
    "plain + monitor": (False, True, False),
    "checkpointed": (True, False, False),
    "checkpointed + monitor": (True, True, False),
    "checkpointed + monitor holding first-run inputs": (True, True, True),
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _in_use() -> int:
    """Bytes malloc has handed out and not taken back: small-block arenas and mmapped blocks."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _peak_over(fn) -> int:
    """The peak of _in_use() while fn runs, over its value before."""
    before, peak, done = _in_use(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _in_use())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _in_use()) - before


def measure(row: str) -> int:
    import torch

    from gradspec.data.models import load_model
    from gradspec.layers import checkpointing
    from gradspec.training.monitor import SpectralMonitor

    checkpointed, monitored, holding = ROWS[row]
    torch.manual_seed(0)
    model, _ = load_model()
    model.train()
    if checkpointed:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if holding:
        import gradspec.layers.linear as linear

        linear.phase = lambda: checkpointing.Phase(checkpointing.PLAIN, None)
    ids = torch.randint(3, 40000, (4, 256))
    monitor = SpectralMonitor(every=1, modules="all")

    def step() -> None:
        model.zero_grad(set_to_none=False)
        if monitored:
            with monitor.step(model):
                model(input_ids=ids, labels=ids).loss.backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()

    step()
    return _peak_over(step)


def test_peak_memory_under_checkpointing():
    peaks = {}
    for row in ROWS:
        proc = subprocess.run([sys.executable, __file__, row], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[row] = int(proc.stdout.strip().splitlines()[-1])
    print("\nPeak memory of one step over the memory before it (SmolLM2-135M, 4 x 256 tokens, monitor on all):")
    for row, peak in peaks.items():
        print(f"  {row:50s} {peak / 2**20:8.0f} MiB  {peak / peaks['checkpointed']:5.2f}x checkpointed")


if __name__ == "__main__":
    print(measure(sys.argv[1]))
