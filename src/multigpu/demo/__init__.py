"""The demo: a small CNN on scikit-learn's handwritten digits, trained once per strategy."""
