"""What the stack test measured (image sizes, build times, times to healthy), filled by the
fixtures and tests and printed at the end of the run (conftest.py): one module, so that the
conftest and the test modules share one dict."""

FIGURES: dict[str, float] = {}
