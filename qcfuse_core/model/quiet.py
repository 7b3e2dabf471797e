"""Models load without progress bars: transformers' loader draws a "Loading weights" bar on
stderr at every load, and a library draws none (the command line's own bars are its
business; house style 15).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_BARS = threading.Lock()


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars off while a model loads, then as they were. The switch
    is transformers' own, one flag per process, so loads inside are serialised: another
    load cannot turn it back on halfway."""
    from transformers.utils import logging as hf_logging

    with _BARS:
        was = hf_logging.is_progress_bar_enabled()
        if was:
            hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()
