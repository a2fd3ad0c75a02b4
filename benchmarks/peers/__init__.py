"""Against other tools: per-sample spectra with Opacus and torch.func, and preconditioned alignment with
bergson (each peer in a venv of its own, made by the *_env.sh scripts here)."""
