"""gradspec inside other data engines (optional extras): gradspec.integrations.ray, a Ray Data stage."""
