"""nanpass: make PyTorch models numerically safe by rewriting their graphs."""

from ._backend import Backend as Backend
from ._backend import backend as backend
from ._certify import Certificate as Certificate
from ._certify import Verdict as Verdict
from ._certify import certify as certify
from ._check import NonFiniteError as NonFiniteError
from ._check import NonFiniteWarning as NonFiniteWarning
from ._compat import CompatError as CompatError
from ._config import Config as Config
from ._enable import Enabled as Enabled
from ._enable import enable as enable
from ._errors import CaptureError as CaptureError
from ._errors import ConfigError as ConfigError
from ._errors import NanpassError as NanpassError
from ._errors import NanpassTypeError as NanpassTypeError
from ._errors import RewriteError as RewriteError
from ._harden import Hardened as Hardened
from ._harden import harden as harden
from ._integrations import GatedScheduler as GatedScheduler
from ._integrations import GuardedOptimizer as GuardedOptimizer
from ._locate import Finding as Finding
from ._locate import locate as locate
from ._report import Report as Report
from ._report import ReportError as ReportError
from ._report import report as report
from ._rewrite import Change as Change
from . import _fastpath
from ._rewrite import GraphRecord as GraphRecord
from ._rewrite import summary as summary
from ._rules import RULES as RULES
from ._rules import Rule as Rule
from ._search import SearchFinding as SearchFinding
from ._search import search as search
from ._shapes import ShapeError as ShapeError
from ._shapes import ShapeTable as ShapeTable
from ._shapes import check_shapes as check_shapes
from ._spike import SkipSampler as SkipSampler
from ._spike import SpikeError as SpikeError
from ._spike import SpikeGuard as SpikeGuard
from ._stats import GuardWarning as GuardWarning
from ._stats import Stats as Stats
from ._stats import stats as stats
from ._train import StepGuard as StepGuard
from ._train import finite_mean as finite_mean
from ._train import finite_sum as finite_sum

__version__ = "0.1.0"

# the rule table's spellings, replaced once by stand-ins that guard inside a hardened call and
# are torch's own function everywhere else (docs/architecture.md, "The stand-ins")
_fastpath.install()
