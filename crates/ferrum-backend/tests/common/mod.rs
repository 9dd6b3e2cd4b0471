pub mod blocks;
