"""Exact path-dependent TreeSHAP over a Treelite model's trees (Lundberg et al., Algorithm 2), vectorised over rows.

Two ways to the same values. A shallow tree gets a table: a leaf's contributions depend on a row only through which
of the leaf's path features the row agrees with (one bit per distinct feature on the path), so each leaf's weights
are computed once for every bit pattern, and explaining rows becomes a few array lookups per tree (the idea of
Fast TreeSHAP v2, Yang 2021). A tree too deep for its table is walked recursively, all rows at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument

#: A tree gets a table when its leaves x patterns x path features stay under this many entries.
TABLE_LIMIT = 1 << 18

_LEFT_IF = {
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
}


@dataclass
class _Tree:
    left: np.ndarray  # child ids, -1 at leaves
    right: np.ndarray
    feature: np.ndarray
    threshold: np.ndarray
    op: list  # the comparison sending a row left, per node (None at leaves)
    default_left: np.ndarray  # where a missing (NaN) value goes
    cover: np.ndarray  # training rows (or hessian sum) through each node
    value: np.ndarray  # (nodes, groups): leaf outputs, already scaled and placed in their class column
    table: _Table | None = None


@dataclass
class _Table:
    """Per leaf: the path's split nodes and directions, the distinct feature (slot) each split tests, and the
    contribution multipliers of every slot for every pattern of agreeing slots."""

    internal: np.ndarray  # ids of the split nodes
    path_nodes: (
        np.ndarray
    )  # (leaves, depth): position in `internal` of each split on the leaf's path (padded: 0)
    path_left: np.ndarray  # (leaves, depth): the direction the path takes there
    path_bit: np.ndarray  # (leaves, depth): 1 << slot of that split's feature (padding: 0)
    full: np.ndarray  # (leaves,): all the leaf's slot bits
    weights: np.ndarray  # (leaves, 2**slots, slots): multiplier of the leaf value for each slot
    onehot: np.ndarray  # (leaves * slots, features): which feature each slot is
    leaf_value: np.ndarray  # (leaves, groups)


class TreeShap:
    """SHAP values of a Treelite model in its raw-score space (before its postprocessor: margins, not
    probabilities), as XGBoost's `pred_contribs`, LightGBM's `pred_contrib` and shap's TreeExplainer give them."""

    def __init__(self, model_json: str):
        doc = json.loads(model_json)
        if int(doc.get("num_target", 1)) != 1:
            raise InvalidArgument("TreeSHAP here explains models with one target")
        self.num_features = int(doc["num_feature"])
        self.groups = max(1, int(max(doc["num_class"])))
        raw_trees = doc["trees"]
        class_ids = [int(c) for c in doc.get("class_id", [-1] * len(raw_trees))]
        # each class column averages (RandomForest) or sums (boosting) the trees that write it
        contributing = np.zeros(self.groups)
        for cid in class_ids:
            if cid < 0:
                contributing += 1
            else:
                contributing[cid] += 1
        scale = 1.0 / np.maximum(contributing, 1) if doc.get("average_tree_output") else np.ones(self.groups)
        self.trees = [
            self._tree(t, cid, scale) for t, cid in zip(raw_trees, class_ids) if t.get("num_nodes", 0) > 0
        ]
        base = np.asarray(doc.get("base_scores", [0.0]), dtype=np.float64).ravel()
        self.bias = np.zeros(self.groups) + (base[: self.groups] if base.size >= self.groups else base[0])
        for tree in self.trees:
            self.bias += self._expected_value(tree)
            if tree.left[0] >= 0:
                tree.table = _build_table(tree, self.num_features)

    def _tree(self, doc: dict, class_id: int, scale: np.ndarray) -> _Tree:
        nodes = sorted(doc["nodes"], key=lambda n: n["node_id"])
        n = len(nodes)
        left = np.full(n, -1, np.int64)
        right = np.full(n, -1, np.int64)
        feature = np.full(n, -1, np.int64)
        threshold = np.zeros(n)
        default_left = np.zeros(n, bool)
        cover = np.zeros(n)
        value = np.zeros((n, self.groups))
        ops: list = [None] * n
        for i, node in enumerate(nodes):
            if "sum_hess" in node:
                cover[i] = node["sum_hess"]
            elif "data_count" in node:
                cover[i] = node["data_count"]
            else:
                raise InvalidArgument(
                    "the Treelite model records no node covers (data_count or sum_hess): TreeSHAP needs them"
                )
            if "leaf_value" in node:
                leaf = np.asarray(node["leaf_value"], dtype=np.float64).ravel()
                if class_id >= 0:
                    value[i, class_id] = leaf[0]
                elif leaf.size == self.groups:
                    value[i] = leaf
                else:
                    value[i] = leaf[0]
                value[i] *= scale
                continue
            if node.get("node_type") != "numerical_test_node":
                raise InvalidArgument(
                    f"TreeSHAP here explains numerical splits, not '{node.get('node_type')}'"
                )
            left[i], right[i] = node["left_child"], node["right_child"]
            feature[i] = node["split_feature_id"]
            threshold[i] = node["threshold"]
            default_left[i] = node["default_left"]
            ops[i] = _LEFT_IF[node["comparison_op"]]
        return _Tree(left, right, feature, threshold, ops, default_left, cover, value)

    @staticmethod
    def _expected_value(tree: _Tree) -> np.ndarray:
        leaves = tree.left < 0
        return (tree.value[leaves] * tree.cover[leaves, None]).sum(axis=0) / tree.cover[0]

    def shap_values(self, x: np.ndarray) -> np.ndarray:
        """(rows, groups, num_features + 1): each feature's contribution, the bias (expected value) last."""
        x = np.asarray(x, dtype=np.float64)
        phi = np.zeros((x.shape[0], self.num_features + 1, self.groups))
        phi[:, -1, :] = self.bias
        for tree in self.trees:
            if tree.table is not None:
                _table_values(tree, tree.table, x, phi)
            elif tree.left[0] >= 0:
                _TreeWalk(tree, x, phi).run()
        return phi.transpose(0, 2, 1)


def _paths(tree: _Tree) -> list[tuple[int, list[tuple[int, bool]]]]:
    """Every leaf with the (split node, goes left) steps from the root to it."""
    out = []
    stack: list[tuple[int, list[tuple[int, bool]]]] = [(0, [])]
    while stack:
        node, path = stack.pop()
        if tree.left[node] < 0:
            out.append((node, path))
            continue
        stack.append((int(tree.right[node]), path + [(node, False)]))
        stack.append((int(tree.left[node]), path + [(node, True)]))
    return out


def _build_table(tree: _Tree, num_features: int) -> _Table | None:
    paths = _paths(tree)
    slots_of = []
    for _, path in paths:
        feats: list[int] = []
        for node, _ in path:
            if int(tree.feature[node]) not in feats:
                feats.append(int(tree.feature[node]))
        slots_of.append(feats)
    slots = max(len(f) for f in slots_of)
    depth = max(len(p) for _, p in paths)
    if len(paths) * (1 << slots) * slots > TABLE_LIMIT:
        return None
    internal = np.flatnonzero(tree.left >= 0)
    position = {int(n): i for i, n in enumerate(internal)}
    n_leaves = len(paths)
    path_nodes = np.zeros((n_leaves, depth), np.int64)
    path_left = np.zeros((n_leaves, depth), bool)
    path_bit = np.zeros((n_leaves, depth), np.int64)
    full = np.zeros(n_leaves, np.int64)
    weights = np.zeros((n_leaves, 1 << slots, slots))
    onehot = np.zeros((n_leaves * slots, num_features))
    patterns = np.arange(1 << slots)
    for li, ((_leaf, path), feats) in enumerate(zip(paths, slots_of)):
        zero = np.ones(len(feats))
        for d, (node, left) in enumerate(path):
            slot = feats.index(int(tree.feature[node]))
            path_nodes[li, d] = position[node]
            path_left[li, d] = left
            path_bit[li, d] = 1 << slot
            child = tree.left[node] if left else tree.right[node]
            zero[slot] *= tree.cover[child] / tree.cover[node]
        full[li] = (1 << len(feats)) - 1
        for slot, f in enumerate(feats):
            onehot[li * slots + slot, f] = 1.0
        if not feats:
            continue
        # the path as the recursion leaves it at this leaf, one column per pattern of agreeing slots
        ones = ((patterns[: 1 << len(feats)][None, :] >> np.arange(len(feats))[:, None]) & 1).astype(
            np.float64
        )
        p_feats: list[int] = []
        p_zeros: list[float] = []
        p_ones = np.zeros((0, ones.shape[1]))
        p_weights = np.zeros((0, ones.shape[1]))
        start = np.ones(ones.shape[1])
        p_feats, p_zeros, p_ones, p_weights = _TreeWalk._extend(
            p_feats, p_zeros, p_ones, p_weights, 1.0, start, -1
        )
        for slot, f in enumerate(feats):
            p_feats, p_zeros, p_ones, p_weights = _TreeWalk._extend(
                p_feats, p_zeros, p_ones, p_weights, float(zero[slot]), ones[slot], f
            )
        w = _TreeWalk._unwound_sums(p_zeros, p_ones, p_weights)  # (slots, patterns)
        weights[li, : 1 << len(feats), : len(feats)] = (w * (ones - zero[:, None])).T
    leaf_value = tree.value[[leaf for leaf, _ in paths]]
    return _Table(internal, path_nodes, path_left, path_bit, full, weights, onehot, leaf_value)


def _table_values(tree: _Tree, table: _Table, x: np.ndarray, phi: np.ndarray) -> None:
    nodes = table.internal
    cols = x[:, tree.feature[nodes]]  # (rows, splits)
    goes_left = np.empty(cols.shape, bool)
    ops = [tree.op[n] for n in nodes]
    for op in set(ops):
        which = np.fromiter((o is op for o in ops), bool, len(ops))
        goes_left[:, which] = op(cols[:, which], tree.threshold[nodes[which]])
    missing = np.isnan(cols)
    if missing.any():
        goes_left = np.where(missing, tree.default_left[nodes], goes_left)
    disagree = goes_left[:, table.path_nodes] != table.path_left  # (rows, leaves, depth)
    failed = np.bitwise_or.reduce(disagree * table.path_bit, axis=2)  # padding has bit 0
    pattern = table.full & ~failed  # (rows, leaves)
    w = table.weights[np.arange(len(table.full)), pattern]  # (rows, leaves, slots)
    contrib = w[..., None] * table.leaf_value[None, :, None, :]  # (rows, leaves, slots, groups)
    rows = contrib.shape[0]
    flat = contrib.reshape(rows, -1, contrib.shape[-1])  # (rows, leaves * slots, groups)
    phi[:, :-1, :] += np.einsum("rkg,kf->rfg", flat, table.onehot)


class _TreeWalk:
    """One tree's contributions for all rows at once. The path's feature and zero fractions are the same for every
    row; the one fractions (does this row follow the split) and the permutation weights are per row."""

    def __init__(self, tree: _Tree, x: np.ndarray, phi: np.ndarray):
        self.tree, self.x, self.phi = tree, x, phi
        self.rows = x.shape[0]

    def run(self) -> None:
        ones = np.ones(self.rows)
        self._recurse(0, [], [], np.zeros((0, self.rows)), np.zeros((0, self.rows)), 1.0, ones, -1)

    @staticmethod
    def _extend(feats, zeros, ones, weights, zero, one, feature):
        """The path with one more element; weights row i is the weight of subsets of size i."""
        d = len(feats)
        if d == 0:
            new = np.ones((1, one.shape[0]))
        else:
            i = np.arange(d + 1, dtype=np.float64)[:, None]
            new = np.zeros((d + 1, one.shape[0]))
            new[:d] = zero * weights * (d - i[:d]) / (d + 1)
            new[1:] += one * weights * i[1:] / (d + 1)
        return feats + [feature], zeros + [zero], np.vstack([ones, one[None]]), new

    @staticmethod
    def _unwind(feats, zeros, ones, weights, k):
        """The path without element k (the inverse of its extend)."""
        d = len(feats) - 1
        one, zero = ones[k], zeros[k]
        has_one = one != 0
        one_safe = np.where(has_one, one, 1.0)
        out = np.empty((d, weights.shape[1]))
        next_one = weights[d].copy()
        for i in range(d - 1, -1, -1):
            via_one = next_one * (d + 1) / ((i + 1) * one_safe)
            via_zero = weights[i] * (d + 1) / (zero * (d - i)) if zero != 0 else np.zeros_like(via_one)
            out[i] = np.where(has_one, via_one, via_zero)
            next_one = weights[i] - out[i] * zero * (d - i) / (d + 1)
        keep = [j for j in range(d + 1) if j != k]
        return [feats[j] for j in keep], [zeros[j] for j in keep], ones[keep], out

    @staticmethod
    def _unwound_sums(zeros, ones, weights):
        """For every path element i >= 1 at once: the total weight of the path without it."""
        d = len(zeros) - 1
        z = np.asarray(zeros[1:], dtype=np.float64)[:, None]
        o = ones[1:]
        has_one = o != 0
        one_safe = np.where(has_one, o, 1.0)
        z_safe = np.where(z != 0, z, 1.0)
        total = np.zeros_like(o)
        next_one = np.broadcast_to(weights[d], o.shape).copy()
        for i in range(d - 1, -1, -1):
            tmp = next_one * (d + 1) / ((i + 1) * one_safe)
            via_zero = np.where(z != 0, (weights[i] / z_safe) * (d + 1) / (d - i), 0.0)
            total += np.where(has_one, tmp, via_zero)
            next_one = weights[i] - tmp * z * (d - i) / (d + 1)
        return total

    def _recurse(self, node, feats, zeros, ones, weights, zero, one, feature) -> None:
        t = self.tree
        feats, zeros, ones, weights = self._extend(feats, zeros, ones, weights, zero, one, feature)
        if t.left[node] < 0:
            if len(feats) > 1:
                w = self._unwound_sums(zeros, ones, weights)  # (path - 1, rows)
                scaled = w * (ones[1:] - np.asarray(zeros[1:])[:, None])
                value = t.value[node]
                for j, f in enumerate(feats[1:]):
                    self.phi[:, f, :] += scaled[j][:, None] * value
            return
        split = int(t.feature[node])
        col = self.x[:, split]
        goes_left = np.where(np.isnan(col), t.default_left[node], t.op[node](col, t.threshold[node]))
        in_zero, in_one = 1.0, np.ones(self.rows)
        if split in feats[1:]:
            k = feats.index(split, 1)
            in_zero, in_one = zeros[k], ones[k]
            feats, zeros, ones, weights = self._unwind(feats, zeros, ones, weights, k)
        cover = t.cover[node]
        lc, rc = int(t.left[node]), int(t.right[node])
        self._recurse(
            lc, feats, zeros, ones, weights, in_zero * t.cover[lc] / cover, in_one * goes_left, split
        )
        self._recurse(
            rc, feats, zeros, ones, weights, in_zero * t.cover[rc] / cover, in_one * ~goes_left, split
        )
