# The rendezvous bucket of one volunteer_rl run, a trainer identity and one identity per
# volunteer. The IAM policy documents are the JSON templates in policies/: the Python test
# tests/integration/test_iam_policy.py renders the same files and checks them against an S3 server with
# IAM enforcement, so what is tested is what is deployed.

locals {
  bucket_arn = aws_s3_bucket.run.arn

  trainer_policy = templatefile("${path.module}/policies/trainer.json.tftpl", {
    bucket_arn = local.bucket_arn
    key_prefix = var.key_prefix
  })
}

# ---------------------------------------------------------------------------------------
# Bucket
# ---------------------------------------------------------------------------------------

resource "aws_s3_bucket" "run" {
  #checkov:skip=CKV_AWS_18:Server access logs would need a second bucket and log every volunteer PUT; enable CloudTrail S3 data events on this bucket where an audit trail is required.
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles cost for data that is reproducible (rollouts) or re-uploadable by the trainer (checkpoints); versioning covers accidental deletes.
  #checkov:skip=CKV_AWS_145:SSE-S3 (AES256) is used on purpose: SSE-KMS would require a kms:Decrypt/GenerateDataKey grant for every volunteer identity and a KMS call per request.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket event notifications; the trainer polls the rollouts/ prefix.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_ownership_controls" "run" {
  bucket = aws_s3_bucket.run.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "run" {
  bucket = aws_s3_bucket.run.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "run" {
  bucket = aws_s3_bucket.run.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "run" {
  bucket = aws_s3_bucket.run.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "run" {
  bucket = aws_s3_bucket.run.id

  # Expiry rules on a versioned bucket only work once versioning is on.
  depends_on = [aws_s3_bucket_versioning.run]

  rule {
    id     = "expire-old-rollouts"
    status = "Enabled"

    filter {
      prefix = "${var.key_prefix}rollouts/"
    }

    expiration {
      days = var.rollout_expiration_days
    }
  }

  dynamic "rule" {
    for_each = var.checkpoint_expiration_days > 0 ? [var.checkpoint_expiration_days] : []

    content {
      id     = "expire-old-checkpoints"
      status = "Enabled"

      filter {
        prefix = "${var.key_prefix}checkpoints/"
      }

      expiration {
        days = rule.value
      }
    }
  }

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    # Whole bucket: this module creates the bucket, so it owns everything in it.
    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    expiration {
      expired_object_delete_marker = true
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }
}

# Refuse plain-HTTP requests from anyone, whatever their IAM policy says.
resource "aws_s3_bucket_policy" "run" {
  bucket = aws_s3_bucket.run.id

  # The public access block must exist first, or AWS may reject the policy call.
  depends_on = [aws_s3_bucket_public_access_block.run]

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "DenyInsecureTransport"
        Effect    = "Deny"
        Principal = "*"
        Action    = "s3:*"
        Resource  = [local.bucket_arn, "${local.bucket_arn}/*"]
        Condition = {
          Bool = { "aws:SecureTransport" = "false" }
        }
      }
    ]
  })
}

# ---------------------------------------------------------------------------------------
# Trainer: one IAM user (it runs outside AWS as often as inside), its policy on a group.
# ---------------------------------------------------------------------------------------

resource "aws_iam_group" "trainers" {
  name = "${var.name_prefix}-trainers"
  path = "/volunteer-rl/"
}

resource "aws_iam_group_policy" "trainers" {
  name   = "${var.name_prefix}-trainer-bucket-access"
  group  = aws_iam_group.trainers.name
  policy = local.trainer_policy
}

resource "aws_iam_user" "trainer" {
  #checkov:skip=CKV_AWS_273:The trainer may run on a host outside AWS (a lab GPU box) where no SSO or instance role exists; a static key scoped to this bucket is the deliverable.
  name = "${var.name_prefix}-trainer"
  path = "/volunteer-rl/"
}

resource "aws_iam_user_group_membership" "trainer" {
  user   = aws_iam_user.trainer.name
  groups = [aws_iam_group.trainers.name]
}

resource "aws_iam_access_key" "trainer" {
  user = aws_iam_user.trainer.name
}

# ---------------------------------------------------------------------------------------
# Volunteers: one IAM user, key and policy each, so one volunteer can be revoked alone and
# none can write under another volunteer's prefix.
# ---------------------------------------------------------------------------------------

resource "aws_iam_user" "volunteer" {
  #checkov:skip=CKV_AWS_273:Volunteers are outside people on their own laptops, not members of the organisation's SSO; each gets a static key limited to its own prefixes.
  for_each = var.volunteers

  name = "${var.name_prefix}-volunteer-${each.key}"
  path = "/volunteer-rl/volunteers/"
  tags = { "volunteer_id" = each.key }
}

# A managed policy per volunteer, not an inline one: IAM caps a user's inline policies at 2,048
# characters in all, which the volunteer policy outgrows; a managed policy may hold 6,144
# (tests/integration/test_terraform.py checks the rendered size against the quota of what holds it).
resource "aws_iam_policy" "volunteer" {
  for_each = var.volunteers

  name        = "${var.name_prefix}-volunteer-${each.key}"
  path        = "/volunteer-rl/volunteers/"
  description = "volunteer_rl: bucket access of volunteer ${each.key}"
  policy = templatefile("${path.module}/policies/volunteer.json.tftpl", {
    bucket_arn   = local.bucket_arn
    key_prefix   = var.key_prefix
    volunteer_id = each.key
  })
}

resource "aws_iam_user_policy_attachment" "volunteer" {
  #checkov:skip=CKV_AWS_40:The policy is different for every volunteer (its own rollouts/ and heartbeat keys), so it cannot be shared through a group.
  for_each = var.volunteers

  user       = aws_iam_user.volunteer[each.key].name
  policy_arn = aws_iam_policy.volunteer[each.key].arn
}

resource "aws_iam_access_key" "volunteer" {
  for_each = var.volunteers

  user = aws_iam_user.volunteer[each.key].name
}
