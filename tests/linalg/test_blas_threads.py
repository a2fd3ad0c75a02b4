"""SciPy's BLAS held at one thread while any extension call runs, from any thread, and restored
to what it was once the last call leaves, however the calls interleave."""

import threading

from gradspec.linalg.blas_threads import OneBlasThread


class ProcessWideBlas:
    """A threadpoolctl controller over a process-wide thread count, as OpenBLAS's is."""

    def __init__(self, threads: int) -> None:
        self.threads, self.calls = threads, []

    def limit(self, limits, user_api):
        saved = self.threads
        self.threads = limits
        self.calls.append("limit")
        blas = self

        class Limiter:
            def restore_original_limits(self):
                blas.threads = saved
                blas.calls.append("restore")

        return Limiter()


def test_interleaved_calls_from_two_threads_hold_the_limit_and_restore_it():
    """a enters, b enters, a leaves (b still inside: one thread), b leaves (the user's count back).
    Separate save/restore per call would give the user's count while b runs and leave 1 after."""
    blas = ProcessWideBlas(threads=4)
    one = OneBlasThread(blas)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with one():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with one():
            b_in.set()
            a_out.wait(5)
            seen["b alone"] = blas.threads

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"b alone": 1} and blas.threads == 4
    assert blas.calls == ["limit", "restore"]


def test_nested_calls_on_one_thread_set_and_restore_once():
    blas = ProcessWideBlas(threads=2)
    one = OneBlasThread(blas)
    with one(), one():
        with one():
            assert blas.threads == 1
    assert blas.threads == 2 and blas.calls == ["limit", "restore"]


def test_nothing_to_limit_without_a_controller():
    with OneBlasThread(None)():
        pass
