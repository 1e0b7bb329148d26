//! The products through the engine on the host: `gather_k_mm` against its definition
//! (`gather_k`), and the fused products' rules and CPU answer (`fused`).

mod fused;
mod gather_k;
