"""The reports draw on matplotlib's object-oriented API: importing them switches no global backend and
loads no pyplot (a program that uses pyplot itself keeps its own backend)."""

import subprocess
import sys


def test_the_reports_leave_pyplot_and_the_backend_alone():
    code = ("import sys, matplotlib\n"
            "before = matplotlib.rcParams._get_backend_or_none()\n"
            "import gradspec.analysis.report, gradspec.analysis.monitor_report, gradspec.validation.report\n"
            "print('matplotlib.pyplot' in sys.modules, matplotlib.rcParams._get_backend_or_none() == before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]
