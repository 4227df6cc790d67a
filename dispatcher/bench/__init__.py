"""``twogrid bench``: a load generator against any OpenAI-compatible server, in ``vllm bench serve``'s terms.

Imported only by the ``bench`` subcommand (it pulls in aiohttp, numpy and, for ``--plot``, matplotlib):
``datasets`` builds the requests, ``client`` streams one request and times it, ``server_metrics`` scrapes
Prometheus counters, ``results`` turns timed requests into vLLM's result fields, ``runner`` drives the runs and
``plot`` draws saved results.
"""

from dispatcher.plan.config import ConfigError


class BenchError(ConfigError):
    """A bench run that cannot go on: the message is one line naming the flag, file or URL and what is wrong."""
