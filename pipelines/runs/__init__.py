"""One gate run: the runner (quantize -> serve -> score -> gate -> promote) and its run folder."""
