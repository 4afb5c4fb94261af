"""matplotlib without a display: every figure here is written to a PNG file."""


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
