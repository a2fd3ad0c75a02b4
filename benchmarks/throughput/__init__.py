"""How fast: gradspec against its floor (forward and input-gradient backward), the reference and the
other commands (align, the store, Ray, a million rows), and on a loaded machine."""
