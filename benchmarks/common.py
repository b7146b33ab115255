"""What the benchmark scripts share: prompt text and load readings."""
from __future__ import annotations

import pydoc


def english_text() -> str:
    """About 20k tokens of English prose: the documentation of a few standard modules."""
    import argparse
    import collections
    import json
    import logging
    import pathlib
    import subprocess
    import threading
    import unittest
    return "\n\n".join(pydoc.getdoc(m) + "\n" + "\n".join(pydoc.getdoc(getattr(m, n)) for n in dir(m)
                                                          if not n.startswith("_") and callable(getattr(m, n)))
                       for m in (unittest, logging, argparse, threading, collections, subprocess, pathlib, json))


def load_1min() -> float:
    """The 1-minute load average (start a measurement only below 0.8)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])
