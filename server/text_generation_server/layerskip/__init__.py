"""Input-adaptive layer skipping: identity map, detector, decider, plans and policy files.

This package imports nothing else of text_generation_server (only torch, numpy, safetensors
and, for bitsandbytes weights, bitsandbytes), so it also applies to other engines.
"""

from .bypass import bypassed
from .decider import Condition, Rule, RuleTable
from .detector import FEATURES, DetectorConfig, DetectorScores, detect, detect_batch
from .draft import DraftSettings, DraftVocab
from .fingerprint import FingerprintConfig, distance
from .identity import DecoderLayers, IdentityMap, LayerIdentity, align, find_decoder_layers
from .plan import MODES, LayerSkipMode, SkipPlan
from .policy import (
    AlignedPolicy,
    Calibration,
    LayerRef,
    Policy,
    PolicyRule,
    align_policy,
    load_policy,
    read_policy,
    save_policy,
)
from .scheduler import ConsistencyReport, Scheduler

__all__ = [
    "FEATURES", "MODES", "AlignedPolicy", "Calibration", "Condition", "ConsistencyReport",
    "DecoderLayers", "DetectorConfig", "DetectorScores", "DraftSettings", "DraftVocab", "FingerprintConfig",
    "IdentityMap",
    "LayerIdentity", "LayerRef", "LayerSkipMode", "Policy", "PolicyRule", "Rule", "RuleTable", "Scheduler",
    "SkipPlan", "align", "align_policy", "bypassed", "detect", "detect_batch", "distance",
    "find_decoder_layers", "load_policy", "read_policy", "save_policy",
]
