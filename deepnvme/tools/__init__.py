"""deepnvme's command-line tools, kept apart from the library (the library never imports from here).

- :mod:`.report`  ``ds_report``: what this machine can build and run, and why not
- :mod:`.ds_io`   ``ds_io``: DeepSpeed's I/O benchmark flags and result lines
- :mod:`.tune`    ``ds_nvme_tune``: search the aio_handle settings that reach a drive's speed
- :mod:`.demo`    ``deepnvme demo``: one tensor through aio_handle beside torch.save/load
- :mod:`.command` ``deepnvme report|io|tune|demo`` (also ``python -m deepnvme``): the tools under a name
  that only deepnvme installs
- :mod:`.ownership` every run's first line and JSON field: the tool is deepnvme's; how to run DeepSpeed's
- :mod:`.cli`     what the tools share: sizes, the handle settings for writing input files, usage errors
- :mod:`.pagecache`, :mod:`.sizes`, :mod:`.pattern`   honest reads, K/M/G sizes, test-buffer fill

Each tool also runs as ``python -m deepnvme.tools.<name>``.
"""
