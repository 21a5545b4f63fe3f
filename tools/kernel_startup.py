"""Run (with runpy, so the learner's namespace stays empty) by every IPython kernel of the
workbook's .venv that starts inside a workbook checkout (tools/bootstrap.sh writes the venv's
`etc/ipython/ipython_kernel_config.py`, which looks for this file): `%%writefile` becomes the
workbook's, which keeps the version a cell replaces in .history/, writes a module's parts in
place and refuses targets outside the notebook's tree, even in a notebook whose first cell
(`guard`) has not run. Anywhere else it does nothing. It must never break a kernel: any failure
is one printed line."""


def _register_workbook_writefile() -> None:
    import pathlib
    import sys

    here = pathlib.Path.cwd().resolve()
    root = next((p for p in (here, *here.parents)
                 if (p / "tools" / "nbtools.py").is_file() and (p / "minisgl").is_dir()), None)
    if root is None:
        return
    try:
        if str(root) not in sys.path:
            sys.path.append(str(root))  # the notebooks' first cell puts it first anyway
        from tools.nbtools import register_writefile

        register_writefile()
    except Exception as exc:  # noqa: BLE001 - a kernel must start whatever happens here
        print(f"minisgl workbook: the workbook's %%writefile is off in this kernel ({exc}); run the "
              "notebook's first cell, which turns them on")


_register_workbook_writefile()
