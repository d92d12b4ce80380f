# The rendezvous bucket of one volunteer_rl run on a self-hosted MinIO, a trainer user and
# one user per volunteer. MinIO speaks the S3 policy language, so the policies are the AWS
# module's JSON templates minus the one statement MinIO cannot express: it has no
# s3:if-none-match condition key, so shards are not create-only here (docs/DEPLOY.md).
# tests/integration/test_terraform.py checks that they differ by exactly that, tests/integration/test_iam_policy.py
# checks their effect against an S3 server with IAM enforcement.

locals {
  bucket_arn = "arn:aws:s3:::${minio_s3_bucket.run.bucket}"
}

resource "minio_s3_bucket" "run" {
  bucket        = var.bucket_name
  acl           = "private"
  force_destroy = var.force_destroy
}

resource "minio_s3_bucket_versioning" "run" {
  bucket = minio_s3_bucket.run.bucket

  versioning_configuration {
    status = "Enabled"
  }
}

resource "minio_ilm_policy" "run" {
  bucket = minio_s3_bucket.run.bucket

  depends_on = [minio_s3_bucket_versioning.run]

  rule {
    id         = "expire-old-rollouts"
    filter     = "${var.key_prefix}rollouts/"
    expiration = "${var.rollout_expiration_days}d"
  }

  dynamic "rule" {
    for_each = var.checkpoint_expiration_days > 0 ? [var.checkpoint_expiration_days] : []

    content {
      id         = "expire-old-checkpoints"
      filter     = "${var.key_prefix}checkpoints/"
      expiration = "${rule.value}d"
    }
  }

  rule {
    id = "expire-noncurrent-versions"

    noncurrent_expiration {
      days = "${var.noncurrent_version_expiration_days}d"
    }
  }
}

# ---------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------

resource "minio_iam_policy" "trainer" {
  name = "${var.name_prefix}-trainer"
  policy = templatefile("${path.module}/policies/trainer.json.tftpl", {
    bucket_arn = local.bucket_arn
    key_prefix = var.key_prefix
  })
}

# MinIO generates the secret key; the user name is the access key.
resource "minio_iam_user" "trainer" {
  name = "${var.name_prefix}-trainer"
}

resource "minio_iam_user_policy_attachment" "trainer" {
  user_name   = minio_iam_user.trainer.id
  policy_name = minio_iam_policy.trainer.id
}

# ---------------------------------------------------------------------------------------
# Volunteers
# ---------------------------------------------------------------------------------------

resource "minio_iam_policy" "volunteer" {
  for_each = var.volunteers

  name = "${var.name_prefix}-volunteer-${each.key}"
  policy = templatefile("${path.module}/policies/volunteer.json.tftpl", {
    bucket_arn   = local.bucket_arn
    key_prefix   = var.key_prefix
    volunteer_id = each.key
  })
}

resource "minio_iam_user" "volunteer" {
  for_each = var.volunteers

  name = "${var.name_prefix}-volunteer-${each.key}"
}

resource "minio_iam_user_policy_attachment" "volunteer" {
  for_each = var.volunteers

  user_name   = minio_iam_user.volunteer[each.key].id
  policy_name = minio_iam_policy.volunteer[each.key].id
}
