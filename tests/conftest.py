"""Fixtures shared by every test folder: the S3 server and the test control plane (see e2e/README.md)."""

pytest_plugins = ["spotrl_e2e.pytest_plugin"]
