"""What the GPU checks (tests/test_cuda.py) allow, in one place, each backed by a CPU run in the
suite (tests/test_bf16_emulation.py) that shows the figure holds with room to spare."""

# float32 with TF32 off (train.bf16: false): the modes see the same global batches and differ only
# in the order sums are taken, about 1e-6 of a step's gradient. Adam divides each step by the
# gradient's running size, so a weight whose gradient is near zero moves by the full step either
# way, and after 20 steps at the recipe's lr the weights part by up to about 1e-2 of their norm
# (the emulation: 9e-3 between one device and any split). A loss scaled wrongly for uneven shares
# parts them by 8e-2 or more.
FP32_RELATIVE_TOLERANCE = 0.03

# bf16 rounds at 8 bits of mantissa, each rank's share on its own, so the modes' weights part by
# tens of percent after 20 steps (the emulation: 25% between one device and an 8-way split): no
# weight tolerance tells a bug from bf16. What bf16 must keep is the accuracy: validation accuracy
# after the same 20 steps (about 87% there) within this of float32's.
BF16_ACCURACY_TOLERANCE = 0.08
