"""One widget per panel of `kvops top`; app.py composes them."""
