"""Prebuilt op modules (``<name>_op``) land here when installed with DS_BUILD_*=1."""
