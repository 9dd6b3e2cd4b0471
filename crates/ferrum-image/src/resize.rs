//! Pillow's resampling of 8-bit images (`Image.resize` with a filter, no `reducing_gap`):
//! a horizontal pass then a vertical one, each output value a window of input values times
//! coefficients — the filter at the input's distance, scaled by the reduction and normalised
//! to sum to one —, the coefficients rounded to 22 fractional bits and the sums to 8-bit
//! values. transformers' PIL image processors resize through it, so this gives their bytes.

use crate::decode::RgbImage;

/// Pillow's resampling filters (its `Image.Resampling` codes 1–5; 0, NEAREST, is not one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Lanczos,
    Bilinear,
    Bicubic,
    Box,
    Hamming,
}

impl Filter {
    /// From Pillow's code, as processor configs give `resample`.
    pub fn from_pil(code: i64) -> Option<Filter> {
        Some(match code {
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            _ => return None,
        })
    }

    fn support(self) -> f64 {
        match self {
            Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    x.sin() / x * (0.54 + 0.46 * x.cos())
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

/// Fractional bits of the fixed-point coefficients (Pillow's `PRECISION_BITS`).
const BITS: u32 = 32 - 8 - 2;

/// For each output position, the first input position of its window, the window's length,
/// and its fixed-point coefficients (`ksize` a position).
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    k: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize, filter: Filter) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut k = vec![0i32; out_size * ksize];
    let mut w = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast: toward zero.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin).min(ksize);
        let mut total = 0.0;
        for (x, wx) in w.iter_mut().enumerate().take(n) {
            *wx = filter.weight((x as f64 + xmin as f64 - center + 0.5) * ss);
            total += *wx;
        }
        let row = &mut k[xx * ksize..(xx + 1) * ksize];
        for x in 0..n {
            let v = if total != 0.0 { w[x] / total } else { w[x] };
            let f = v * f64::from(1u32 << BITS);
            row[x] = if v < 0.0 {
                (-0.5 + f) as i32
            } else {
                (0.5 + f) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs { ksize, bounds, k }
}

fn clip8(v: i32) -> u8 {
    (v >> BITS).clamp(0, 255) as u8
}

/// One horizontal pass: each row of `img`'s rows `first..first + rows` resampled to `width`.
fn horizontal(img: &RgbImage, first: usize, rows: usize, width: usize, filter: Filter) -> RgbImage {
    let ch = coeffs(img.width, width, filter);
    let mut out = vec![0u8; rows * width * 3];
    for r in 0..rows {
        let src = &img.data[(first + r) * img.width * 3..(first + r + 1) * img.width * 3];
        let dst = &mut out[r * width * 3..(r + 1) * width * 3];
        for (xx, &(xmin, n)) in ch.bounds.iter().enumerate() {
            let k = &ch.k[xx * ch.ksize..xx * ch.ksize + n];
            let mut ss = [1i32 << (BITS - 1); 3];
            for (x, &kx) in k.iter().enumerate() {
                let p = &src[(xmin + x) * 3..(xmin + x) * 3 + 3];
                for c in 0..3 {
                    ss[c] += i32::from(p[c]) * kx;
                }
            }
            for c in 0..3 {
                dst[xx * 3 + c] = clip8(ss[c]);
            }
        }
    }
    RgbImage {
        width,
        height: rows,
        data: out,
    }
}

/// One vertical pass with coefficients `cv`, whose windows start `first` rows above `img`'s
/// first row (`img` holds only the rows they read).
fn vertical(img: &RgbImage, cv: &Coeffs, first: usize) -> RgbImage {
    let stride = img.width * 3;
    let mut out = vec![0u8; stride * cv.bounds.len()];
    for (yy, &(ymin, n)) in cv.bounds.iter().enumerate() {
        let k = &cv.k[yy * cv.ksize..yy * cv.ksize + n];
        let dst = &mut out[yy * stride..(yy + 1) * stride];
        for (i, d) in dst.iter_mut().enumerate() {
            let mut ss = 1i32 << (BITS - 1);
            for (y, &ky) in k.iter().enumerate() {
                ss += i32::from(img.data[(ymin - first + y) * stride + i]) * ky;
            }
            *d = clip8(ss);
        }
    }
    RgbImage {
        width: img.width,
        height: cv.bounds.len(),
        data: out,
    }
}

/// `img` resized to `width` × `height` as Pillow's `Image.resize(…, resample=filter)`.
///
/// The pass order is Pillow 13's: vertical first when the height shrinks by more than twice
/// what the width does, else horizontal first (Pillow 12 and older: always horizontal
/// first; the two orders round the intermediate image differently).
pub fn resize(img: &RgbImage, width: usize, height: usize, filter: Filter) -> RgbImage {
    let need_h = width != img.width;
    let need_v = height != img.height;
    let shrink_v = img.height as i64 - height as i64;
    let shrink_h = img.width as i64 - width as i64;
    let horizontal_first = !(shrink_v > 0 && shrink_v > shrink_h * 2);
    match (need_h, need_v) {
        (false, false) => img.clone(),
        (true, false) => horizontal(img, 0, img.height, width, filter),
        (false, true) => vertical(img, &coeffs(img.height, height, filter), 0),
        (true, true) if horizontal_first => {
            let cv = coeffs(img.height, height, filter);
            // The horizontal pass covers only the rows the vertical one reads.
            let first = cv.bounds.first().map_or(0, |b| b.0);
            let last = cv.bounds.last().map_or(0, |b| b.0 + b.1);
            let tmp = horizontal(img, first, last - first, width, filter);
            vertical(&tmp, &cv, first)
        }
        (true, true) => {
            let tmp = vertical(img, &coeffs(img.height, height, filter), 0);
            horizontal(&tmp, 0, height, width, filter)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(w: usize, h: usize) -> RgbImage {
        let data = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
        RgbImage {
            width: w,
            height: h,
            data,
        }
    }

    #[test]
    fn same_size_is_a_copy() {
        let img = image(7, 5);
        for f in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos] {
            assert_eq!(resize(&img, 7, 5, f), img);
        }
    }

    /// A flat image stays flat whatever the filter and ratio (coefficients sum to one).
    #[test]
    fn flat_stays_flat() {
        let img = RgbImage {
            width: 13,
            height: 9,
            data: vec![77; 13 * 9 * 3],
        };
        for f in [
            Filter::Box,
            Filter::Bilinear,
            Filter::Hamming,
            Filter::Bicubic,
            Filter::Lanczos,
        ] {
            for (w, h) in [(4, 4), (30, 2), (13, 20), (1, 1)] {
                let r = resize(&img, w, h, f);
                assert!(r.data.iter().all(|&v| v == 77), "{f:?} {w}x{h}");
            }
        }
    }
}
