"""benchmarks/peers/bergson_scores.py with bergson's module filter set, for a comparison on the modules
gradspec scores (bench_preconditioned.py: q/k/v/o only).

    OUT/.venv-bergson/bin/python benchmarks/peers/bergson_filtered.py --filter-modules "*.mlp.*,lm_head" \
        [every bergson_scores.py option]

bergson_scores.py takes bergson's default modules (every linear weight); bergson itself can leave
modules out by name (IndexConfig.filter_modules: comma-separated globs of the modules NOT
collected, applied to the query build, the Hessian fit and the scoring alike). This sets it on every
IndexConfig the run makes (through the __post_init__ every IndexConfig's constructor calls) and then
runs bergson_scores.main unchanged. Which modules bergson kept is in its query index's info.json
(grad_sizes), under --workdir.
"""

import sys
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    if "--filter-modules" not in argv:
        sys.exit("usage: bergson_filtered.py --filter-modules GLOBS [bergson_scores.py options]")
    i = argv.index("--filter-modules")
    globs = argv[i + 1]
    del argv[i:i + 2]

    from bergson.config.config import IndexConfig

    inherited = IndexConfig.__post_init__

    def post_init(self) -> None:
        if self.filter_modules is None:
            self.filter_modules = globs
        inherited(self)

    IndexConfig.__post_init__ = post_init

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bergson_scores

    sys.argv = [bergson_scores.__file__, *argv]
    bergson_scores.main()


if __name__ == "__main__":
    main()
