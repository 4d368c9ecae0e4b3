"""The digits MLP of `elastic demo` as a target for the CLI:

    elastic run examples/digits.py:job --workers 4 --epochs 10 --global-batch 64 --kill-at 30:1
"""

from elastic.demo import digits_job

job = digits_job()
