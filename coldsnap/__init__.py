"""coldsnap: capture an initialized LLM serving process once, restore it in seconds.

Importing coldsnap touches no GPU and imports no engine; the native extension ``coldsnap._C`` is
loaded only when something asks for it.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
