"""A fake CANN (fake_cann.c) for testing the NPU backend without an NPU; see build.py."""
