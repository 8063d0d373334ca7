//! The solve plan: everything about one GPTQ solve that is bookkeeping rather than arithmetic —
//! the processing order and its inverse, which scale/zero row each processing position uses,
//! when the group parameters are found, which groups start in a block, and `g_idx` — computed once
//! from the factorization's order and the settings, and followed by both backends (the CPU loop in
//! `solver.rs` and the GPU loop in `cuda.rs`). docs/algorithm.md, Post-processing, gives the rules.

use std::ops::Range;

use crate::scheme::{ActOrder, GroupSize};

/// When the group parameters (scale, zero) are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamsAt {
    /// One group per row: from the whole matrix, before dead columns are zeroed.
    Whole,
    /// Static act-order: per original group, from the dead-zeroed weights in original order,
    /// before the loop.
    BeforeLoop,
    /// Dynamic act-order or none: when a group of processing positions starts, from W as the
    /// lazy updates of earlier blocks left it.
    InLoop,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SolvePlan {
    pub k: usize,
    /// Columns per group (K for one group per row).
    pub group_len: usize,
    /// Scale/zero rows (`[n_groups, N]`).
    pub n_groups: usize,
    pub params_at: ParamsAt,
    /// Processing position → original column.
    pub perm: Vec<usize>,
    /// Original column → processing position.
    pub invperm: Vec<usize>,
    /// Processing position → the scale/zero row it is quantized with.
    pub param_row: Vec<usize>,
    /// Original column → the scale/zero row stored for it.
    pub g_idx: Vec<i32>,
}

impl SolvePlan {
    /// The plan for processing order `perm` (from the factorization) under these settings.
    pub fn new(perm: &[usize], group_size: GroupSize, act_order: ActOrder) -> Self {
        let k = perm.len();
        let g = group_size.len(k).max(1);
        let mut invperm = vec![0usize; k];
        for (c, &j) in perm.iter().enumerate() {
            invperm[j] = c;
        }
        let params_at = match (group_size, act_order) {
            (GroupSize::PerRow, _) => ParamsAt::Whole,
            (_, ActOrder::Static) => ParamsAt::BeforeLoop,
            (_, ActOrder::Dynamic | ActOrder::Off) => ParamsAt::InLoop,
        };
        // Static rows are original groups; otherwise rows follow processing positions.
        let param_row = match act_order {
            ActOrder::Static => perm.iter().map(|&j| j / g).collect(),
            ActOrder::Dynamic | ActOrder::Off => (0..k).map(|c| c / g).collect(),
        };
        // Scale rows are already in the order g_idx refers to.
        let g_idx = match act_order {
            ActOrder::Dynamic => invperm.iter().map(|&c| (c / g) as i32).collect(),
            ActOrder::Static | ActOrder::Off => (0..k).map(|j| (j / g) as i32).collect(),
        };
        Self {
            k,
            group_len: g,
            n_groups: group_size.count(k),
            params_at,
            perm: perm.to_vec(),
            invperm,
            param_row,
            g_idx,
        }
    }

    /// The plan of natural column order (act-order off; round-to-nearest takes its `g_idx`).
    pub fn natural(k: usize, group_size: GroupSize) -> Self {
        let perm: Vec<usize> = (0..k).collect();
        Self::new(&perm, group_size, ActOrder::Off)
    }

    /// The scale/zero rows whose parameters are found when the block of processing positions
    /// `cols` starts (`ParamsAt::InLoop` only; empty otherwise): the groups whose first position
    /// falls in the block.
    pub fn groups_starting_in(&self, cols: Range<usize>) -> Range<usize> {
        if self.params_at != ParamsAt::InLoop {
            return 0..0;
        }
        let g = self.group_len;
        cols.start.div_ceil(g)..cols.end.div_ceil(g)
    }

    /// The processing positions of group row `t` (in-loop parameters are found over them).
    pub fn group_cols(&self, t: usize) -> Range<usize> {
        t * self.group_len..((t + 1) * self.group_len).min(self.k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: i64) -> GroupSize {
        GroupSize::from_i64(n).unwrap()
    }

    #[test]
    fn static_order_keeps_original_groups_and_trivial_g_idx() {
        let perm = [3, 0, 2, 1];
        let p = SolvePlan::new(&perm, g(2), ActOrder::Static);
        assert_eq!(p.params_at, ParamsAt::BeforeLoop);
        assert_eq!(p.invperm, [1, 3, 2, 0]);
        assert_eq!(p.param_row, [1, 0, 1, 0]);
        assert_eq!(p.g_idx, [0, 0, 1, 1]);
        assert_eq!(p.n_groups, 2);
    }

    #[test]
    fn dynamic_order_follows_processing_positions() {
        let perm = [3, 0, 2, 1];
        let p = SolvePlan::new(&perm, g(2), ActOrder::Dynamic);
        assert_eq!(p.params_at, ParamsAt::InLoop);
        assert_eq!(p.param_row, [0, 0, 1, 1]);
        // g_idx[j] = invperm[j] / g
        assert_eq!(p.g_idx, [0, 1, 1, 0]);
        // Each stored row is used by exactly the columns g_idx assigns to it.
        for (c, &j) in perm.iter().enumerate() {
            assert_eq!(p.g_idx[j] as usize, p.param_row[c]);
        }
    }

    #[test]
    fn groups_start_where_their_first_position_falls() {
        let perm: Vec<usize> = (0..300).rev().collect();
        let p = SolvePlan::new(&perm, g(64), ActOrder::Dynamic);
        assert_eq!(p.n_groups, 5);
        assert_eq!(p.groups_starting_in(0..128), 0..2);
        assert_eq!(p.groups_starting_in(128..256), 2..4);
        assert_eq!(p.groups_starting_in(256..300), 4..5);
        assert_eq!(p.group_cols(4), 256..300);
        // Groups larger than a block start in every other block.
        let p = SolvePlan::new(&perm, g(256), ActOrder::Dynamic);
        assert_eq!(p.groups_starting_in(0..128), 0..1);
        assert_eq!(p.groups_starting_in(128..256), 1..1);
        assert_eq!(p.groups_starting_in(256..300), 1..2);
        // Before-loop plans find nothing in the loop; natural order finds them there too.
        let p = SolvePlan::new(&perm, g(64), ActOrder::Static);
        assert!(p.groups_starting_in(0..128).is_empty());
        let p = SolvePlan::natural(300, g(64));
        assert_eq!(p.params_at, ParamsAt::InLoop);
        assert_eq!(p.groups_starting_in(0..128), 0..2);
    }

    #[test]
    fn one_group_per_row_is_found_from_the_whole_matrix() {
        let perm = [1, 0, 2];
        for a in [ActOrder::Static, ActOrder::Dynamic, ActOrder::Off] {
            let p = SolvePlan::new(&perm, GroupSize::PerRow, a);
            assert_eq!(p.params_at, ParamsAt::Whole);
            assert_eq!((p.group_len, p.n_groups), (3, 1));
            assert_eq!(p.g_idx, [0, 0, 0]);
            assert_eq!(p.param_row, [0, 0, 0]);
        }
    }
}
