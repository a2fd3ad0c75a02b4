"""gradspec: score SFT data by the spectra of per-sample layer-wise gradients."""
