"""Which parameter goes to Muon and which to AdamW, and why.

Muon is for the matrices of hidden layers. Everything else stays on AdamW:
embeddings (and any weight tied to one), the output head, norms, biases and
every tensor with fewer than two dimensions. `route_parameters` decides for
every trainable parameter, in this order of precedence:

1. user patterns (``muon_params`` / ``adamw_params``, globs on the full name);
2. module type: ``nn.Embedding``, ``nn.EmbeddingBag`` and norm layers -> AdamW;
3. weights tied to an embedding -> AdamW (once);
4. what a training batch showed, where one was traced (``graph=``, `trace_roles`): every matrix whose output
   feeds the loss through no other matrix is an output head, every one that reads the batch through no other
   matrix an input layer (both -> AdamW); a matrix it saw in neither role is hidden; a tensor it used, but never
   as a matrix (only added, multiplied elementwise, indexed, ...), is a table or a scale (-> AdamW), whatever its
   name; what no batch has reached yet keeps the rules below, marked in the table, until a batch reaches it;
5. the output heads -> AdamW (`find_output_heads`: the model's own conventions first);
6. the input layer (a first conv on the raw input channels) -> AdamW;
7. layout and shape: conv kernels (flattened), ``in x out`` weights (transformers' ``Conv1D``) and
   stacks of matrices (each orthogonalised on its own; ``E x in x out`` where the experts say so) -> Muon;
   bare token and position tables, stacks of vectors (a bias per expert, a router's gate vectors) and PEFT
   adapters' scales and coefficients (DoRA's magnitude, IA3's vectors, ...) -> AdamW, 2D weights -> Muon,
   everything smaller -> AdamW.

A parametrization's tensors go by what they are, with their layer's rules (``parametrizations.weight.original1``,
weight norm's direction, is its conv's kernel; ``original0``, its magnitude, a scale per output -> AdamW; spectral
norm's and orthogonal's ``original`` the matrix they make), the reason naming the parametrization.

Every route says which of these rules decided (`Rule`), and why in words. Frozen parameters go nowhere. The
result holds ordinary param groups (with a ``name`` per group and the parameter names) and a table of every
decision.

The modules behind this face: ``_vocabulary`` (`Algorithm`, `Rule`), ``_roles`` (what the model says about a
module: heads, input layer, tables), ``_trace`` (what a training batch shows), ``_rules`` (the decision),
``_route`` (`Route`), ``_routing`` (`Routing`), ``_settings`` (each group's own settings) and ``_table`` (the
table).
"""

from lightning_muon.routing._roles import find_output_heads
from lightning_muon.routing._route import Route
from lightning_muon.routing._routing import Routing
from lightning_muon.routing._rules import check_pattern_list, route_parameters
from lightning_muon.routing._settings import SETTING_KEYS, check_group_settings, check_settings_taken
from lightning_muon.routing._trace import GraphRoles, loss_in, trace_roles, trace_step
from lightning_muon.routing._vocabulary import ADAMW, MUON, Algorithm, Group, Rule

__all__ = [
    "ADAMW", "MUON", "SETTING_KEYS", "Algorithm", "GraphRoles", "Group", "Route", "Routing", "Rule",
    "check_group_settings", "check_pattern_list", "check_settings_taken", "find_output_heads",
    "loss_in", "route_parameters", "trace_roles", "trace_step",
]
