"""Test-only harnesses (not installed with the package): SGLang's CPU import prelude, the fake
SGLang backend with the pinned release's signatures, the rank bodies that drive SGLang's real
modules on gloo ranks, and the real-module helpers they share."""
