# Chapter 01 (01_req_batch_context.ipynb): the package root of minisgl.
"""minisgl: a CPU re-build of mini-sglang's stage 1, written chapter by chapter.

Sub-packages, in the order the workbook builds them: ``core`` and ``distributed`` (chapter 01),
``layers`` (02), ``models`` (03), ``kvcache`` (04), ``attention`` (05), ``engine`` (06).
``step0`` (chapter 00) is the naive generator they replace.
"""

__version__ = "0.1.0"
