"""The old import path of :mod:`mnb.notebook.config_reference` (docs/config.md from the fields' docstrings).

The generator lives in ``mnb/notebook/``; this module keeps ``from mnb.config_reference import ...`` and
``python -m mnb.config_reference [--write]`` working.
"""

from mnb.notebook.config_reference import CLASSES, DOC_PATH, field_docs, main, markdown, undocumented

__all__ = ["CLASSES", "DOC_PATH", "field_docs", "main", "markdown", "undocumented"]

if __name__ == "__main__":
    raise SystemExit(main())
