"""A site's own presets: ``KDSWEEP_CONFIG_DIR=/path/to/conf`` puts that directory first on Hydra's config search
path, so ``cluster=mysite`` finds ``/path/to/conf/cluster/mysite.yaml``, and a file of a shipped preset's name
(``cluster/gpu_node.yaml``) is used instead of the shipped one. (``hydra.searchpath`` appends after the primary
config, where the shipped presets win: hence a search-path plugin, which may prepend.)"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONFIG_DIR_ENV = "KDSWEEP_CONFIG_DIR"


class KdsweepSiteSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        where = os.environ.get(CONFIG_DIR_ENV)
        if where:
            search_path.prepend(provider="kdsweep-site", path=f"file://{Path(where).expanduser().resolve()}")
