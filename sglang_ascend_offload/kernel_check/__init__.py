"""The AscendC kernels of ``ascendc_ops/`` checked on CPU (``check-kernels``).

* :mod:`.headers`: where the AscendC headers are (``$SAO_ASCENDC_HEADERS``,
  ``$ASCEND_HOME_PATH``, ``../shared/third_party/asc-devkit-8.5.0``) and the generated
  pieces a compile needs (in ``ascendc_ops/build/kernel_check/``);
* :mod:`.compile_check`: syntax-only compile of every kernel, vector and cube variant,
  with a negative control and a content-hash cache;
* :mod:`.stubgen`: regenerates ``ascendc_ops/tools/ascendc_cpu_stubs/stub_generated.h``;
* :mod:`.model` / :mod:`.functional`: the kernels' C++ on a functional model of the
  AscendC API, against the reference compositions of ``ops/fused.py``;
* :mod:`.cli`: ``python -m sglang_ascend_offload check-kernels [--json]``.

Works from a checkout (it reads ``ascendc_ops/``); see docs/fused_ops.md, "What is
checked on CPU".
"""
