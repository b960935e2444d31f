"""The lab: what measures and explains fastsft_lab's optimizations (the library never imports it).

``harness`` (interleaved variants, statistics, JSON), ``scenario`` (the template every benchmark follows),
``scenarios/`` (one per optimization), ``plots`` (every chart), ``results`` (committed results, read back; shipped
as package data for installed copies), ``timelines`` (copy/compute overlap metrics and the schedule model),
``cli`` (``python -m fastsft_lab``).
"""
