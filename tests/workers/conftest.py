"""The scripts here are run as separate processes by the launcher; pytest must not import them."""

collect_ignore_glob = ["*.py"]
