"""The parallelism planner: memory per device and step time of a TP x CP x PP x DP layout, and a search.

``tools/plan_parallelism.py`` is the command line; everything here is a pure function of a model
(``ModelConfig``), a workload (sequence length, global batch, precision), a layout and the hardware.
inputs.py holds those inputs and the parameters each pipeline rank holds; memory.py the peak memory of
a device, experts.py what an MoE layer keeps, sends and computes, time.py the step time, search.py the
layouts megalite accepts and the fastest that fit; flags.py translates between a layout and
pretrain_gpt.py's flags.
"""
