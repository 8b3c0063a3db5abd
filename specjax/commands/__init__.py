"""The ``specjax`` command's subcommands, one module per concern: ``decode`` (generate,
demo), ``bench``, ``hsd`` (calibrate, tune) and ``train`` (distill, features, train),
``convert`` (convert-head);
``common`` holds what they share. ``specjax.cli`` assembles them."""
